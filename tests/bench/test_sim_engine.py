"""bench.sim's engine model against vLLM v1's rules (pure; no engine started)."""

from __future__ import annotations

import random

from bench.sim.cost import CostModel
from bench.sim.engine import Engine, EngineConfig, SimRequest
from bench.sim.kvpool import BlockPool
from bench.sim.seqhash import SequenceHashes
from cache_policy.hashing import block_hashes

BS = 16
UNIT = CostModel(step=1.0, seq=0.0, token=0.0, key=0.0)  # every step takes one second


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(8, 30000) for _ in range(n)]


def request(name: str, prompt: list[int], max_tokens: int = 1, cap: int | None = None) -> SimRequest:
    return SimRequest(name, tuple(block_hashes(prompt, BS)), len(prompt), max_tokens, cache_cap_tokens=cap)


def drain(engine: Engine) -> list[SimRequest]:
    done = []
    while engine.wake_at is not None:
        done += engine.wake(engine.wake_at)
    engine.pool.check_integrity()
    return done


def engine(**kw) -> Engine:
    return Engine("r0", EngineConfig(block_size=BS, cost=UNIT, **kw))


def test_a_prompt_of_whole_blocks_hits_one_block_less_and_a_ragged_one_all_full_blocks():
    for n, expected in ((64, 48), (70, 64)):
        e = engine(num_blocks=64)
        p = tokens(n, 1)
        e.submit(request("a", p), 0.0)
        drain(e)
        b = request("b", p)
        e.submit(b, e.stats.busy_s)
        drain(e)
        assert b.cached_tokens == expected, n
        assert e.stats.prefilled_tokens == 2 * n - expected


def test_the_scoring_cap_limits_the_hit_rounded_down_to_a_block():
    e = engine(num_blocks=64)
    p = tokens(96, 2)
    e.submit(request("a", p), 0.0)
    drain(e)
    b = request("b", p, cap=40)
    e.submit(b, 10.0)
    drain(e)
    assert b.cached_tokens == 32


def test_freed_blocks_are_evicted_tail_first_and_uncached_blocks_before_cached_ones():
    e = engine(num_blocks=10)
    a = tokens(4 * BS + 5, 3)  # 4 full blocks + a partial 5th; 1 output token lands in the partial block
    e.submit(request("a", a), 0.0)
    drain(e)
    pool = e.pool
    assert pool.num_free == 10 and pool.num_cached == 4
    # Free queue: 5 never-used blocks in id order, then ... the partial block was prepended.
    first = next(iter(pool.free_queue))
    assert pool.block_hash[first] is None
    # Taking 1 + 5 blocks leaves a's 4 cached blocks; each further block evicts a's tail first.
    pool.take(6)
    hashes = block_hashes(a, BS)
    for left in (3, 2, 1, 0):
        pool.take(1)
        assert len(pool.lookup(hashes, 10)) == left
        assert all(h in pool.by_hash for h in hashes[:left])


def test_a_hit_block_is_taken_out_of_the_free_queue_and_survives_later_allocations():
    pool = BlockPool(4)
    blocks = pool.take(2)
    pool.cache(blocks[0], 111)
    pool.cache(blocks[1], 222)
    pool.free(reversed(blocks))
    hit = pool.lookup((111, 222), 2)
    assert hit == blocks and pool.evictable_among(hit) == 2
    pool.touch(hit)
    pool.take(2)  # the two never-used blocks; the hit ones are not free
    assert pool.num_free == 0 and pool.lookup((111, 222), 2) == blocks
    pool.check_integrity()


def test_chunked_prefill_takes_ceil_prompt_over_budget_steps_then_one_step_per_token():
    for run in (1, 64):
        e = engine(num_blocks=64, max_num_batched_tokens=32, max_decode_run=run)
        r = request("a", tokens(100, 4), max_tokens=5)
        e.submit(r, 0.0)
        drain(e)
        assert r.first_token_s == 4.0  # 32 + 32 + 32 + 4 tokens
        assert r.finish_s == 8.0  # 4 more decode steps
        assert r.output_tokens == 5


def test_out_of_blocks_preempts_the_last_scheduled_request_which_recomputes_later():
    e = engine(num_blocks=12, max_decode_run=1)
    a, b = request("a", tokens(40, 5), max_tokens=60), request("b", tokens(40, 6), max_tokens=60)
    e.submit(a, 0.0)
    e.submit(b, 0.0)
    done = drain(e)
    assert {r.req_id for r in done} == {"a", "b"}
    assert b.num_preemptions >= 1 and a.num_preemptions == 0  # b was scheduled last
    assert e.stats.preemptions == b.num_preemptions
    assert e.stats.recomputed_tokens > 0
    assert a.finish_s < b.finish_s


def test_folded_decode_runs_give_the_same_times_and_counts_as_single_steps():
    def run(fold: int):
        e = Engine("r", EngineConfig(num_blocks=200, block_size=BS, max_decode_run=fold,
                                     cost=CostModel(step=0.01, seq=0.001, token=1e-5, key=1e-7)))
        sh = SequenceHashes(BS)
        reqs = []
        for i in range(6):
            p = tokens(50 + 30 * i, 10 + i)
            reqs.append(SimRequest(f"q{i}", sh.with_unique_tail(tuple(block_hashes(p, BS)), len(p), len(p) + 40),
                                   len(p), 20 + 7 * i))
        arrivals = [0.0, 0.05, 0.3, 0.31, 0.9, 1.7]
        pending = list(zip(arrivals, reqs))
        while pending or e.wake_at is not None:
            if pending and (e.wake_at is None or pending[0][0] < e.wake_at):
                t, r = pending.pop(0)
                e.submit(r, t)
            else:
                e.wake(e.wake_at)
        return [(r.first_token_s, r.finish_s, r.cached_tokens) for r in reqs], e.stats.steps

    one, folded = run(1), run(64)
    assert one[1] == folded[1]
    for (f1, d1, c1), (f2, d2, c2) in zip(one[0], folded[0]):
        assert abs(f1 - f2) < 1e-9 and abs(d1 - d2) < 1e-9 and c1 == c2


def test_a_request_admitted_in_the_same_step_hits_the_blocks_that_step_computes():
    e = engine(num_blocks=64)
    e.submit(request("x", tokens(40, 7), max_tokens=3), 0.0)  # the engine is now busy for a step
    p = tokens(100, 8)
    a, b = request("a", p), request("b", p)
    e.submit(a, 0.0)
    e.submit(b, 0.0)
    drain(e)
    assert a.first_token_s == b.first_token_s  # one step admitted both
    assert a.cached_tokens == 0 and b.cached_tokens == 96  # vLLM caches blocks when it schedules them
