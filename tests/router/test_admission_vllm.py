"""Admission against a real vLLM-CPU replica with a small KV cache (128 blocks of 32 tokens).

The overload test runs the benchmark's scenario (``bench.overload``) twice in one test, with
admission on and then off, on the same replica, and compares the replica's own counters.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import pytest_asyncio

from bench.overload import OverloadWorkload, compare, render
from router import keys
from router.config import AppConfig
from router.server import running_router
from tests.engine_brake import EngineBrake
from tests.router.small_replica import small_replica

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def small():
    async with small_replica() as replica_set:
        yield replica_set


async def test_overload_admission_keeps_prefixes_and_avoids_preemption(small):
    watermark = 0.6
    cfg = AppConfig().replace(router={"scrape_interval_s": 0.2},
                              policy={"high_watermark": watermark, "session_idle_s": 1.0, "queue_timeout_s": 20.0})
    workload = OverloadWorkload(num_sessions=10, turns=3)
    on, off = await compare(cfg, small.endpoints, workload)
    print("\n" + render([on, off]))
    continuing = workload.num_sessions * (workload.turns - 1)
    assert on.turns == off.turns == workload.num_sessions * workload.turns
    # admission on: usage held near the watermark, no preemption, continuing turns keep their prefix
    assert on.peak_kv_usage <= watermark + 0.1, on
    assert on.preemptions == 0, on
    assert on.reprefills <= continuing // 4 and on.reprefills < off.reprefills // 2, on
    # admission off, same replica, same workload: the cache overflows (whether the engine also
    # preempts depends on how many decodes overlap: a loaded CI host once ran them apart, 0)
    assert off.peak_kv_usage >= watermark + 0.2, off
    assert off.reprefills >= continuing // 2, off
    assert on.prefilled_tokens < off.prefilled_tokens and on.hit_rate > off.hit_rate


async def test_over_capacity_is_429_with_retry_after(small):
    cfg = AppConfig().replace(router={"port": 0, "scrape_interval_s": 0.2}, policy={"max_queue": 0, "max_queue_per_replica": 0})
    body = {"prompt": [300] * 1000, "max_tokens": 1000, "ignore_eos": True}  # 63 blocks: about half the cache
    pgid = (await small.info(small.endpoints[0].replica_id)).pid
    async with running_router(cfg, small.endpoints) as (url, app), EngineBrake(pgid) as brake:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
            first = asyncio.ensure_future(http.post(url + "/v1/completions", json=body))
            core = app[keys.CORE]
            # the engine is held as soon as the first request is dispatched: it is still running
            # when the second one asks (on a loaded machine it could otherwise finish first)
            await brake.hold_when(lambda: any(core.in_flight(rid) for rid in core.replicas), 60,
                                  what="the first request dispatched")
            async with http.post(url + "/v1/completions", json=body) as r:
                payload = await r.json()
            assert any(core.in_flight(rid) for rid in core.replicas)
            brake.release()
            assert r.status == 429 and int(r.headers["Retry-After"]) >= 1, payload
            assert payload["error"]["type"] == "rate_limit_error"
            async with await first as r:
                assert r.status == 200
            async with http.get(url + "/metrics") as r:
                text = await r.text()
    assert 'rollout_router_admission_rejected_total{reason="queue_full"} 1.0' in text
    assert "rollout_router_admission_projected_kv_usage" in text
