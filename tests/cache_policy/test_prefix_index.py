"""PrefixIndex: contiguous matching, LRU eviction from the tail, bounded size."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_policy.prefix_index import PrefixIndex
from cache_policy.types import BlockHash, ReplicaId

A, B, C = ReplicaId("a"), ReplicaId("b"), ReplicaId("c")


def hs(*values: int) -> list[BlockHash]:
    return [BlockHash(v) for v in values]


def test_match_counts_leading_blocks_per_replica() -> None:
    index = PrefixIndex(100)
    index.insert(hs(1, 2, 3, 4), A)
    index.insert(hs(1, 2), B)
    index.insert(hs(9), C)
    assert index.match(hs(1, 2, 3, 4, 5)) == {A: 4, B: 2}
    assert index.match(hs(1, 2, 7)) == {A: 2, B: 2}
    assert index.match(hs(9, 2)) == {C: 1}
    assert index.match(hs(5, 1)) == {}
    assert index.match([]) == {}
    index.check_integrity()


def test_match_stops_at_first_block_not_held() -> None:
    index = PrefixIndex(100)
    index.insert(hs(1, 3), A)  # a hole at block 1 of (1, 2, 3)
    index.insert(hs(2), A)
    assert index.match(hs(1, 2, 3)) == {A: 3}
    index.insert(hs(1, 3), B)
    assert index.match(hs(1, 2, 3)) == {A: 3, B: 1}


def test_remove_replica() -> None:
    index = PrefixIndex(100)
    index.insert(hs(1, 2), A)
    index.insert(hs(1, 3), B)
    index.remove_replica(A)
    assert index.match(hs(1, 2)) == {B: 1}
    assert len(index) == 2 and index.replicas() == {B}
    assert index.blocks_of(A) == 0 and index.blocks_of(B) == 2
    index.remove_replica(A)  # idempotent
    index.check_integrity()


def test_eviction_takes_a_prefix_tail_first() -> None:
    index = PrefixIndex(4)
    index.insert(hs(1, 2, 3, 4), A)
    index.insert(hs(10, 11), B)  # evicts blocks 4 and 3, keeps the head 1, 2
    assert len(index) == 4
    assert index.match(hs(1, 2, 3, 4)) == {A: 2}
    assert index.match(hs(10, 11)) == {B: 2}
    index.check_integrity()


def test_match_refreshes_lru() -> None:
    index = PrefixIndex(3)
    index.insert(hs(1), A)
    index.insert(hs(2), A)
    index.insert(hs(3), A)
    index.match(hs(1))  # 1 is now the most recently used
    index.insert(hs(4), A)  # evicts 2
    assert index.match(hs(1)) == {A: 1}
    assert index.match(hs(2)) == {}


def test_size_bounded_under_churn() -> None:
    rng = random.Random(0)
    index = PrefixIndex(500)
    replicas = [A, B, C]
    for i in range(5000):
        head = [BlockHash(rng.randrange(10))]  # a few shared heads
        tail = [BlockHash(rng.randrange(2**63)) for _ in range(rng.randrange(1, 20))]
        index.insert(head + tail, rng.choice(replicas))
        assert len(index) <= 500
        if i % 500 == 0:
            index.check_integrity()
    index.check_integrity()
    assert sum(index.blocks_of(r) for r in replicas) >= len(index)


def test_invalid_capacity() -> None:
    with pytest.raises(ValueError, match="max_blocks"):
        PrefixIndex(0)


def test_remove_forgets_only_the_given_blocks_of_one_replica() -> None:
    from cache_policy.prefix_index import PrefixIndex
    from cache_policy.types import BlockHash, ReplicaId

    index = PrefixIndex(max_blocks=100)
    a, b = ReplicaId("a"), ReplicaId("b")
    hashes = [BlockHash(i) for i in range(1, 6)]
    index.insert(hashes, a)
    index.insert(hashes[:2], b)
    index.remove(hashes[2:], a)
    assert index.match(hashes) == {a: 2, b: 2}
    index.remove(hashes[:2], b)
    assert index.match(hashes) == {a: 2}
    assert len(index) == 2
    index.check_integrity()


_OPS = st.lists(st.tuples(st.sampled_from(["insert", "defer", "confirm", "match", "remove", "expire", "fed"]),
                          st.lists(st.integers(0, 30), min_size=1, max_size=12), st.sampled_from([A, B, C]),
                          st.floats(0, 5)), max_size=40)


@settings(max_examples=300, deadline=None)
@given(_OPS)
def test_a_deferred_insert_reads_exactly_as_an_immediate_one(ops) -> None:
    """``insert(defer=True)`` is applied before any other call looks at the index: two indexes fed
    the same calls, one inserting at once and one deferring, answer every read alike (eviction
    order and prediction stamps included) whether or not ``settle`` ran in between."""
    now_index, later_index = PrefixIndex(16, predicted_ttl_s=2.0), PrefixIndex(16, predicted_ttl_s=2.0)
    clock = 0.0
    for k, (op, values, replica, dt) in enumerate(ops):
        clock += dt
        hashes = hs(*values)
        for index in (now_index, later_index):
            if op in ("insert", "defer"):
                index.insert(hashes, replica, clock, defer=op == "defer" and index is later_index)
            elif op == "confirm":
                index.confirm(hashes, replica, clock)
            elif op == "remove":
                index.remove(hashes, replica)
            elif op == "expire":
                index.expire(clock)
            elif op == "fed":
                index.set_event_fed(replica, fed=dt < 2.5)
        if op == "match":
            assert now_index.match(hashes, clock) == later_index.match(hashes, clock)
        if k % 3 == 0:
            later_index.settle()
    assert now_index.stats() == later_index.stats()
    assert list(now_index._entries.items()) == list(later_index._entries.items())
    later_index.check_integrity()


def test_a_deferred_insert_waits_for_settle_or_the_next_read() -> None:
    index = PrefixIndex(100)
    index.insert(hs(1, 2, 3), A, defer=True)
    assert index._deferred and not index._entries  # noted, not applied
    index.settle()
    assert not index._deferred and list(index._entries) == hs(3, 2, 1)
    index.insert(hs(4, 5), B, defer=True)
    assert index.match(hs(4, 5, 6)) == {B: 2}  # a read applies it first


class _Naive:
    """An independent model of the index: a dict per block, LRU by re-inserting keys, expiry by
    scanning every entry. Slow and plain, for the model test below."""

    def __init__(self, capacity: int, ttl: float, fed: set[ReplicaId], batch: int = 0) -> None:
        self.capacity, self.ttl, self.fed, self.batch = capacity, ttl, fed, batch
        self.entries: dict[BlockHash, dict[ReplicaId, float | None]] = {}
        self.expired = 0

    def _take(self, h: BlockHash) -> dict[ReplicaId, float | None]:
        holders = self.entries.pop(h, {})
        self.entries[h] = holders  # most recently used
        return holders

    def _evict(self) -> None:
        if len(self.entries) > self.capacity:  # past capacity: down to capacity - batch
            while len(self.entries) > self.capacity - self.batch:
                del self.entries[next(iter(self.entries))]

    def insert(self, hashes, replica, now) -> None:
        for h in reversed(hashes):
            holders = self._take(h)
            if replica not in holders or holders[replica] is not None:
                holders[replica] = now
        self._evict()

    def confirm(self, hashes, replica) -> None:
        for h in reversed(hashes):
            self._take(h)[replica] = None
        self._evict()

    def expire(self, now) -> None:
        for h, holders in list(self.entries.items()):
            for r, state in list(holders.items()):
                if r in self.fed and state is not None and state + self.ttl < now:
                    del holders[r]
                    self.expired += 1
            if not holders:
                del self.entries[h]

    def remove(self, hashes, replica) -> None:
        for h in hashes:
            holders = self.entries.get(h)
            if holders is not None and replica in holders:
                del holders[replica]
                if not holders:
                    del self.entries[h]

    def match(self, hashes, now) -> dict[ReplicaId, int]:
        self.expire(now)
        result = {}
        for r in {r for holders in self.entries.values() for r in holders}:
            depth = 0
            while depth < len(hashes) and r in self.entries.get(hashes[depth], {}):
                depth += 1
            if depth:
                result[r] = depth
        for h in reversed(hashes[:max(result.values(), default=0)]):
            self._take(h)
        return result

    def blocks_of(self, replica) -> int:
        return sum(replica in holders for holders in self.entries.values())

    def confirmed_of(self, replica) -> int:
        return sum(holders.get(replica, 0.0) is None for holders in self.entries.values())


_MODEL_OPS = st.lists(st.tuples(st.sampled_from(["insert", "confirm", "match", "remove", "expire"]),
                                # a prompt's chained block hashes never repeat (each hashes its parent)
                                st.lists(st.integers(0, 30), min_size=1, max_size=12, unique=True),
                                st.sampled_from([A, B, C]),
                                st.floats(0, 2)), max_size=60)


@settings(max_examples=400, deadline=None)
@given(_MODEL_OPS, st.sets(st.sampled_from([A, B, C])), st.sampled_from([None, 0, 5]))
def test_the_index_answers_as_a_plain_dict_per_block_model(ops, fed, batch) -> None:
    """Single holders kept as their replica id (no dict per block) change nothing a caller reads:
    matches, LRU order, per-replica counts, expiry of event-fed predictions, eviction (in
    batches past capacity)."""
    index = PrefixIndex(16, predicted_ttl_s=2.0, evict_batch=batch)
    model = _Naive(16, 2.0, set(fed), 16 // 64 if batch is None else batch)
    for replica in fed:
        index.set_event_fed(replica)
    clock = 0.0
    for op, values, replica, dt in ops:
        clock += dt
        hashes = hs(*values)
        if op == "insert":
            index.insert(hashes, replica, clock)
            model.insert(hashes, replica, clock)
        elif op == "confirm":
            index.confirm(hashes, replica, clock)
            model.confirm(hashes, replica)
        elif op == "remove":
            index.remove(hashes, replica)
            model.remove(hashes, replica)
        elif op == "expire":
            index.expire(clock)
            model.expire(clock)
        else:
            assert index.match(hashes, clock) == model.match(hashes, clock)
        assert list(index._entries) == list(model.entries)
        for r in (A, B, C):
            assert (index.blocks_of(r), index.confirmed_of(r)) == (model.blocks_of(r), model.confirmed_of(r))
        assert index.stats().expired == model.expired
        index.check_integrity()


def test_a_replica_becoming_event_fed_starts_the_expiry_of_its_predictions() -> None:
    index = PrefixIndex(100, predicted_ttl_s=2.0)
    index.insert(hs(1, 2, 3), A, now=0.0)
    index.insert(hs(1, 2), B, now=0.0)
    index.confirm(hs(1), A, now=1.0)
    index.set_event_fed(A)  # at the index's latest time, 1.0
    assert index.expire(2.9) == 0
    assert index.expire(3.1) == 2  # blocks 2 and 3 of A; block 1 was confirmed
    assert index.match(hs(1, 2, 3), 3.1) == {A: 1, B: 2}
    index.check_integrity()


def test_a_block_held_by_one_replica_is_no_object_of_its_own() -> None:
    """The entry of a block one replica without events holds is its id: inserting a 250-block
    prompt allocates no dict per block."""
    index = PrefixIndex(1000)
    index.insert(hs(*range(250)), A)
    assert all(holders is A for holders in index._entries.values())
    index.insert(hs(0, 1), B)
    assert index._entries[BlockHash(0)] == {A: 0.0, B: 0.0} and index.match(hs(0, 1, 2)) == {A: 3, B: 2}
    index.insert(hs(500), B)
    assert index.match(hs(5, 500)) == {A: 1} and index.match(hs(500, 5)) == {B: 1}  # one holder each
    index.remove(hs(5, 500), A)
    assert index.blocks_of(A) == 249 and index.blocks_of(B) == 3
    index.check_integrity()


def test_predictions_made_before_a_replica_is_fed_expire_a_ttl_after_it_is():
    """A first KV-event batch at ``now`` = 100 marks the replica fed: its predictions from time 0
    get ``predicted_ttl_s`` from 100, not from the index's last time (a fresh attacker's report:
    they all expired at the next read)."""
    index = PrefixIndex(100, predicted_ttl_s=10.0)
    index.insert(hs(1, 2, 3), A, 0.0)
    index.set_event_fed(A, now=100.0)
    assert index.match(hs(1, 2, 3), 100.0) == {A: 3}
    assert index.match(hs(1, 2, 3), 110.5) == {}
