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
