"""RedisState against a real redis-server: pins, versions and the registry round-trip."""

from __future__ import annotations

import pytest

from cache_policy.types import BlockHash, ReplicaId, RequestView
from replicas.replica_set import ReplicaEndpoint
from router.shared_state import MemoryState, RedisState, make_state

pytestmark = pytest.mark.asyncio(loop_scope="session")


def _view(session=None, group=None):
    return RequestView((BlockHash(1),), 40, session_id=session, group_id=group)


async def test_pins_round_trip_and_are_per_key(redis_url):
    a, b = RedisState(redis_url, prefix="t1:"), RedisState(redis_url, prefix="t1:")
    try:
        assert await b.pull_pins(_view("s1", "g1")) == {}
        await a.push_pins(_view("s1", "g1"), ReplicaId("replica-1"))
        assert await b.pull_pins(_view("s1", "g1")) == {"session": "replica-1", "group": "replica-1"}
        assert await b.pull_pins(_view("s2")) == {}
        assert await b.pull_pins(_view()) == {}
    finally:
        await a.close()
        await b.close()


async def test_versions_and_registry(redis_url):
    state = RedisState(redis_url, prefix="t2:")
    try:
        await state.set_loaded_version(ReplicaId("replica-0"), 3)
        await state.set_loaded_version(ReplicaId("replica-1"), 4)
        assert await state.loaded_versions() == {"replica-0": 3, "replica-1": 4}
        ep = ReplicaEndpoint(ReplicaId("replica-0"), "http://127.0.0.1:1", 32, 100, "m", True)
        await state.register([ep])
        assert (await state.registered())["replica-0"]["base_url"] == "http://127.0.0.1:1"
    finally:
        await state.close()


async def test_pin_expires_after_ttl(redis_url):
    import asyncio

    state = RedisState(redis_url, prefix="t3:", pin_ttl_s=1)
    try:
        await state.push_pins(_view("s"), ReplicaId("replica-0"))
        await asyncio.sleep(2.1)
        assert await state.pull_pins(_view("s")) == {}
    finally:
        await state.close()


async def test_make_state_validates():
    assert isinstance(make_state("memory", None), MemoryState)
    with pytest.raises(ValueError, match="redis_url"):
        make_state("redis", None)
    with pytest.raises(ValueError, match="router.state"):
        make_state("disk", None)


@pytest.mark.vllm
async def test_two_routers_sharing_redis_keep_sessions_on_one_replica(redis_url, replica_set):
    """Turn 1 through router A, turn 2 through router B: B follows A's pin via Redis."""
    import aiohttp

    from router.config import AppConfig
    from router.server import running_router
    from tests.router.conftest import unique_prompt

    cfg = AppConfig().replace(router={"port": 0, "scrape_interval_s": 0, "state": "redis",
                                      "redis_url": redis_url})
    async with running_router(cfg, replica_set.endpoints) as (url_a, _), \
            running_router(cfg, replica_set.endpoints) as (url_b, _), aiohttp.ClientSession() as http:
        for s in range(6):
            served = []
            for url in (url_a, url_b):
                headers = {"X-Session-Id": f"shared-{s}"}
                body = {"prompt": unique_prompt(900 + s, 64), "max_tokens": 1}
                async with http.post(url + "/v1/completions", json=body, headers=headers) as r:
                    assert r.status == 200
                    served.append(r.headers["X-Rollout-Replica"])
                    reason = r.headers["X-Rollout-Route-Reason"]
            assert served[0] == served[1], (s, served)
            assert reason == "session"
