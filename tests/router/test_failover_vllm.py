"""A replica that cannot be reached: the request moves to a live replica, nothing is lost."""

from __future__ import annotations

import socket

import pytest

from cache_policy.types import ReplicaId
from replicas.replica_set import ReplicaEndpoint
from router import keys
from router.config import AppConfig
from router.server import running_router
from tests.router.conftest import unique_prompt

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]


def _dead_endpoint() -> ReplicaEndpoint:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return ReplicaEndpoint(ReplicaId("replica-dead"), f"http://127.0.0.1:{port}", 32, 1000, "tiny-llama", True)


async def test_completion_and_score_fail_over_from_an_unreachable_replica(router, replica_set):
    live = replica_set.endpoints[0]
    # round robin starts with the first endpoint: the dead one is tried first
    cfg = AppConfig().replace(router={"port": 0, "scrape_interval_s": 0, "policy": "round_robin"})
    async with running_router(cfg, [_dead_endpoint(), live]) as (url, app):
        body = {"prompt": unique_prompt(60, 100), "max_tokens": 2}
        async with router.http.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            assert r.headers["X-Rollout-Replica"] == live.replica_id
        assert app[keys.CORE].replicas[ReplicaId("replica-dead")].healthy is False
        metrics = app[keys.METRICS]
        assert metrics.retries.labels("unreachable")._value.get() == 1

    async with running_router(cfg, [_dead_endpoint(), live]) as (url, app):
        score = {"context": unique_prompt(61, 300), "responses": [unique_prompt(62, 5), unique_prompt(63, 7)]}
        async with router.http.post(url + "/v1/score", json=score) as r:
            payload = await r.json()
            assert r.status == 200, payload
        assert payload["replica"] == live.replica_id
        assert [len(x["logprobs"]) for x in payload["results"]] == [5, 7]
        # one lifecycle (issue 9): a scoring fan-out retries and marks the replica as a completion does
        assert app[keys.METRICS].retries.labels("unreachable")._value.get() == 1
        assert app[keys.CORE].replicas[ReplicaId("replica-dead")].healthy is False


async def test_all_replicas_unreachable_is_a_clear_502(router):
    cfg = AppConfig().replace(router={"port": 0, "scrape_interval_s": 0, "connect_retries": 1})
    async with running_router(cfg, [_dead_endpoint()]) as (url, _):
        async with router.http.post(url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 1}) as r:
            payload = await r.json()
    assert r.status in (502, 503), payload
    assert payload["error"]["message"]
