"""FreeQueueModel against a block pool in vLLM's eviction order (``bench.sim.kvpool.BlockPool``).

The engine side here is the simulator's pool, written from vLLM's ``block_pool.py`` and not
from the model: every request the model says will find ``n`` blocks cached finds at least
``n`` when it is scheduled, whatever the other requests in flight allocate first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings, strategies as st

from bench.sim.kvpool import BlockPool
from cache_policy.free_queue import FreeQueueModel

R = "r0"


@dataclass
class Flight:
    session: int
    hashes: list[int]
    peak: int
    out_blocks: int
    blocks: list[int] = field(default_factory=list)


def h(session: int, i: int) -> int:
    return session * 10_000 + i  # block i of a session's token stream (a chained hash in real life)


def matched_in(pool: BlockPool, hashes: list[int]) -> int:
    """What an exact event-fed index would say the replica holds now."""
    return len(pool.lookup(hashes, len(hashes)))


class _Unbounded(FreeQueueModel):
    """The model never forgetting a stamp: what it predicts is what the bounded model must."""

    @staticmethod
    def _trim(q, capacity_blocks) -> None:
        pass


def run(capacity: int, steps: list[tuple[str, int, int]], twin: FreeQueueModel | None = None) -> tuple[int, int]:
    """Drive sessions through ``steps``; return (predicted, found) blocks summed.

    ``("turn", s, out)``: session ``s`` sends its next turn (prompt = its stream so far,
    ``out`` output blocks to come), scheduled at once after every request in flight grew by
    ``grow`` blocks; ``("grow", k, _)``: the k-th flight decodes one block; ``("end", k, _)``:
    the k-th flight finishes. A turn that would overcommit the pool (sum of peaks) waits (is
    skipped), as admission holds it. ``twin``: a second model driven alike, which must predict the same.
    """
    pool, model = BlockPool(capacity), FreeQueueModel()
    streams: dict[int, int] = {}
    flights: list[Flight] = []
    predicted = found = 0
    for op, a, b in steps:
        if op == "turn":
            if any(f.session == a for f in flights):
                continue
            n = streams.setdefault(a, 2 + a % 3)
            hashes = [h(a, i) for i in range(n)]
            peak = n + b + 1  # full output blocks + the partial last one
            committed = sum(f.peak for f in flights)
            if committed + peak > capacity:
                continue
            predict = model.surviving(R, hashes, matched_in(pool, hashes), capacity - committed)
            if twin is not None:
                assert twin.surviving(R, hashes, matched_in(pool, hashes), capacity - committed) == predict
                twin.hold(R, hashes)
            model.hold(R, hashes)
            hits = pool.lookup(hashes, n)
            assert len(hits) >= predict, f"predicted {predict} cached blocks, the engine had {len(hits)}"
            predicted, found = predicted + predict, found + len(hits)
            pool.touch(hits)
            new = pool.take(n - len(hits))
            for i, blk in enumerate(new, start=len(hits)):
                pool.cache(blk, hashes[i])
            flights.append(Flight(a, hashes, peak, b, hits + new))
        elif op == "grow" and flights:
            f = flights[a % len(flights)]
            if len(f.blocks) < f.peak:
                (blk,) = pool.take(1)
                idx = len(f.blocks)
                if idx < len(f.hashes) + f.out_blocks:
                    pool.cache(blk, h(f.session, idx))
                f.blocks.append(blk)
        elif op == "end" and flights:
            f = flights.pop(a % len(flights))
            pool.free(reversed(f.blocks))
            model.release(R, f.hashes, len(f.hashes) + f.out_blocks, capacity)  # full blocks only
            if twin is not None:
                twin.release(R, f.hashes, len(f.hashes) + f.out_blocks, capacity)
            done = sum(1 for blk in f.blocks if pool.block_hash[blk] is not None)
            streams[f.session] = done  # the next turn reuses every full block of this one
        pool.check_integrity()
        model.check_integrity()
    return predicted, found


step = st.one_of(
    st.tuples(st.just("turn"), st.integers(0, 7), st.integers(0, 3)),
    st.tuples(st.just("grow"), st.integers(0, 7), st.just(0)),
    st.tuples(st.just("end"), st.integers(0, 7), st.just(0)),
)


@settings(max_examples=300, deadline=None)
@given(st.integers(12, 40), st.lists(step, max_size=120))
def test_a_predicted_hit_is_found(capacity, steps):
    run(capacity, steps)


@settings(max_examples=200, deadline=None)
@given(st.integers(12, 20), st.lists(step, min_size=100, max_size=400))
def test_forgetting_old_stamps_predicts_what_remembering_them_all_would(capacity, steps):
    """Stamps are dropped a generation at a time; each dropped one's rank bound passes the
    capacity, so a model that never forgets predicts the same hits."""
    run(capacity, steps, twin=_Unbounded())


def test_an_idle_session_prefix_is_predicted_until_newer_work_would_evict_it():
    # capacity 10: session 0 (2 blocks, 1 output) ends; its 3 full blocks are the free tail
    pool_steps = [("turn", 0, 1), ("grow", 0, 0), ("grow", 0, 0), ("end", 0, 0)]
    predicted, found = run(10, pool_steps + [("turn", 0, 0)])
    assert (predicted, found) == (3, 3)
    model = FreeQueueModel()
    model.hold(R, [h(0, 0), h(0, 1)])
    model.release(R, [h(0, 0), h(0, 1)], 4, 10)  # appended: 2 output blocks, then block 1, block 0
    three = [h(0, 0), h(0, 1), h(0, 2)]
    assert model.surviving(R, three, 3, free_final=4) == 3  # ranks 1, 2 and (output) 3
    assert model.surviving(R, three, 3, free_final=2) == 2
    assert model.surviving(R, three, 3, free_final=0) == 0
    model.hold(R, [h(0, 0)])  # another request holds block 0: it cannot be evicted
    assert model.surviving(R, three, 3, free_final=0) == 1


def test_unknown_blocks_and_reset_predict_no_hit():
    model = FreeQueueModel()
    assert model.surviving(R, [1, 2], 2, free_final=100) == 0
    model.hold(R, [1, 2])
    model.release(R, [1, 2], 2, 100)
    assert model.surviving(R, [1, 2], 2, free_final=100) == 2
    model.reset(R)
    assert model.surviving(R, [1, 2], 2, free_final=100) == 0


def test_a_refused_request_appends_nothing():
    model = FreeQueueModel()
    model.hold(R, [1])
    model.release(R, [1], 1, 100)
    model.hold(R, [7, 8])
    model.release(R, [7, 8], 50, 100, prefilled=False)
    assert model.surviving(R, [1], 1, free_final=1) == 1  # still the newest free block
