"""The expected-cached count never overstates the engine's hit (README "Routing keys": it errs
low), checked against an engine written from vLLM's rules rather than from the core's model:
``bench.sim.kvpool.BlockPool`` (``vllm/v1/core/block_pool.py``: hits touched before a request
allocates, new blocks taken from the free queue's head, a finished request's blocks freed tail
first, hashed ones to the queue's tail and the rest to its head). Generated sequences of requests
sharing prefixes start and end on one small replica (admission off, so nothing but the model
limits what the core predicts); each request is scheduled by the engine right after the core
placed it, with every block it will hold taken at once (the most the work in flight can evict).
Before the free queue's low points (``FreeQueueModel.note``) this found a block evicted while
more work ran and counted once that work ended, as a CI run on real vLLM had."""

from __future__ import annotations

import itertools

from hypothesis import example, given, settings
from hypothesis import strategies as st

from bench.sim.kvpool import BlockPool
from cache_policy.admission import blocks_needed
from cache_policy.config import PolicyConfig
from cache_policy.core import DecisionCore, RequestSpec

BS, BLOCKS = 4, 64
"""Block size (tokens) and the replica's KV blocks; vLLM keeps one as its null block."""


class Engine:
    """One vLLM engine's block pool, driven request by request."""

    def __init__(self) -> None:
        self.pool = BlockPool(BLOCKS - 1)
        self.held: dict[int, list[int]] = {}
        self._fresh = itertools.count(-1, -1)  # output blocks' hashes: nobody's prompt

    def schedule(self, key: int, hashes: tuple[int, ...], prompt: int, generated: int) -> int:
        """Schedule a request (its prompt's full-block hashes, lengths in tokens); the tokens it found cached."""
        hits = self.pool.lookup(hashes, (prompt - 1) // BS)  # the last prompt token is always computed
        self.pool.touch(hits)
        blocks = hits + self.pool.take(blocks_needed(prompt + generated, 0, BS) - len(hits))
        for i in range(len(hits), len(blocks)):
            if i < len(hashes):
                self.pool.cache(blocks[i], hashes[i])
            elif (i + 1) * BS <= prompt + generated:
                self.pool.cache(blocks[i], next(self._fresh))
        self.held[key] = blocks
        return len(hits) * BS

    def finish(self, key: int) -> None:
        self.pool.free(reversed(self.held.pop(key)))  # tail first: block 0 evicted last

    def holds(self) -> int:
        return sum(map(len, self.held.values()))


_START = st.tuples(st.just("start"), st.integers(0, 2), st.integers(4, 150), st.integers(1, 24), st.floats(0, 1))
_OPS = st.lists(st.one_of(_START, st.tuples(st.just("finish"), st.integers(0, 5))), min_size=4, max_size=40)


@settings(max_examples=300, deadline=None)
@given(_OPS)
# a session's turn (10 blocks + an output block), then A (21 blocks) and B (37, a partial one) run at
# once and take the session's output block and blocks 9..5 from the queue's head; B ends; the next
# turn finds blocks 0..4 (20 tokens) where the present check alone counted 6 blocks
@example([("start", 0, 40, 4, 1.0), ("finish", 0), ("start", 1, 80, 4, 1.0), ("start", 2, 140, 6, 1.0),
          ("finish", 1), ("start", 0, 44, 4, 1.0)])
def test_the_expected_cached_count_never_exceeds_what_the_engine_finds(ops):
    core = DecisionCore(PolicyConfig(), admission=False)
    core.add_replica("r0", block_size=BS, num_gpu_blocks=BLOCKS)
    engine, running, now = Engine(), [], 0.0
    for op in ops:
        now += 0.01
        if op[0] == "finish":
            if running:
                job, generated = running.pop(op[1] % len(running))
                job.generated_tokens = generated
                core.finish(job, "ok", now)
                engine.finish(job.id)
            continue
        _, stem, length, max_tokens, share = op
        generated = round(share * max_tokens)
        if engine.holds() + blocks_needed(length + generated, 0, BS) > BLOCKS - 1:
            continue  # the engine would make it wait: outside this check (its hits are judged at scheduling)
        tokens = list(range(1000 * (stem + 1), 1000 * (stem + 1) + length))  # prompts of a stem share prefixes
        job = core.open(RequestSpec(tokens, session_id=f"s{stem}", new_tokens=max_tokens), now)
        core.place(job, now)
        core.admit(job, now)
        found = engine.schedule(job.id, job.view.block_hashes, length, generated)
        assert job.expected_cached_tokens <= found, (job.expected_cached_tokens, found)
        running.append((job, generated))
    core.check_integrity()
