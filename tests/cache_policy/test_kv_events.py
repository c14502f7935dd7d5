"""KV events -> prefix index (pure): confirm, remove, forget, salts, predicted-entry expiry."""

from __future__ import annotations

import random

import pytest

from cache_policy.hashing import block_hashes
from cache_policy.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEventApplier
from cache_policy.prefix_index import PrefixIndex
from cache_policy.types import ReplicaId

A, B = ReplicaId("a"), ReplicaId("b")
BS = 32


def toks(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n)]


def engine_hashes(n: int, base: int) -> tuple[int, ...]:
    """Stand-ins for vLLM's engine hashes: any distinct ints (the router never recomputes them)."""
    return tuple(base + i for i in range(n))


def stored(tokens: list[int], eh: tuple[int, ...], parent=None, salt=None, **kw) -> BlockStored:
    keys = None if salt is None else ((salt,),) + (None,) * (len(eh) - 1)
    return BlockStored(eh, parent, tuple(tokens), BS, keys, **kw)


@pytest.fixture
def index() -> PrefixIndex:
    return PrefixIndex(10_000, predicted_ttl_s=10.0)


def test_stored_chain_confirms_the_router_hashes(index) -> None:
    t = toks(5 * BS + 7, 1)
    applier = KvEventApplier(index, BS)
    eh = engine_hashes(5, 1000)
    # vLLM stores the first 3 blocks, then 2 more chained on block 2's engine hash
    applier.apply(A, [stored(t[: 3 * BS], eh[:3]), stored(t[3 * BS : 5 * BS], eh[3:], parent=eh[2])], now=1.0)
    expected = block_hashes(t, BS)
    assert len(expected) == 5
    assert index.match(expected) == {A: 5}
    assert index.confirmed_of(A) == 5 and index.stats().predicted == 0
    assert (applier.counts(A).stored, applier.counts(A).unmapped, applier.counts(A).events) == (5, 0, 2)
    index.check_integrity()


def test_unknown_parent_is_left_out(index) -> None:
    t = toks(4 * BS, 2)
    applier = KvEventApplier(index, BS)
    applier.apply(A, [stored(t[2 * BS :], engine_hashes(2, 50), parent=999)], now=0.0)
    assert len(index) == 0 and applier.counts(A).unmapped == 2


def test_removed_takes_only_that_replica_off_the_entry(index) -> None:
    t = toks(3 * BS, 3)
    applier = KvEventApplier(index, BS)
    applier.apply(A, [stored(t, engine_hashes(3, 10))], now=0.0)
    applier.apply(B, [stored(t, engine_hashes(3, 77))], now=0.0)
    applier.apply(A, [BlockRemoved((12,))], now=0.5)  # the tail block of A
    hashes = block_hashes(t, BS)
    assert index.match(hashes) == {A: 2, B: 3}
    applier.apply(A, [BlockRemoved((10,))], now=0.6)  # the head block: A's prefix is gone
    assert index.match(hashes) == {B: 3}
    assert applier.counts(A).removed == 2
    index.check_integrity()


def test_all_blocks_cleared_forgets_the_replica(index) -> None:
    t = toks(2 * BS, 4)
    applier = KvEventApplier(index, BS)
    applier.apply(A, [stored(t, engine_hashes(2, 10))], now=0.0)
    applier.apply(B, [stored(t, engine_hashes(2, 10))], now=0.0)
    index.insert(block_hashes(toks(BS, 9), BS), A, now=0.0)  # a prediction goes too
    applier.apply(A, [AllBlocksCleared()], now=1.0)
    assert index.blocks_of(A) == 0 and index.match(block_hashes(t, BS)) == {B: 2}
    assert applier.counts(A).resets == 1


def test_salts_keep_versions_apart(index) -> None:
    t = toks(2 * BS, 5)
    applier = KvEventApplier(index, BS)
    applier.apply(A, [stored(t, engine_hashes(2, 10), salt="v1")], now=0.0)
    applier.apply(A, [stored(t, engine_hashes(2, 20), salt="v2")], now=0.0)
    v1, v2, plain = block_hashes(t, BS, "v1"), block_hashes(t, BS, "v2"), block_hashes(t, BS)
    assert index.match(v1) == {A: 2} and index.match(v2) == {A: 2} and index.match(plain) == {}
    applier.apply(A, [BlockRemoved((10,))], now=0.1)
    assert index.match(v1) == {} and index.match(v2) == {A: 2}


@pytest.mark.parametrize("event", [
    BlockStored((1,), None, tuple(range(BS)), BS, ((("img-1", 0),),)),  # multimodal key
    BlockStored((1,), None, tuple(range(BS)), BS, (("lora-x", "salt"),), lora_name="lora-x"),
    BlockStored((1,), None, tuple(range(64)), 64),  # another block size
    BlockStored((1,), None, tuple(range(BS)), BS, medium="CPU"),  # an offload tier
    BlockStored((1,), None, tuple(range(BS)), BS, group_idx=1),  # another KV cache group
    BlockStored((1, 2), None, tuple(range(BS)), BS),  # tokens for one block, two hashes
])
def test_blocks_the_router_cannot_rebuild_are_left_out(index, event) -> None:
    applier = KvEventApplier(index, BS)
    applier.apply(A, [event], now=0.0)
    assert len(index) == 0 and applier.counts(A).unmapped == len(event.block_hashes)


def test_a_later_block_with_extra_keys_stops_the_chain(index) -> None:
    t = toks(3 * BS, 6)
    applier = KvEventApplier(index, BS)
    applier.apply(A, [BlockStored((1, 2, 3), None, tuple(t), BS, (None, None, (("img", 64),)))], now=0.0)
    assert index.match(block_hashes(t, BS)) == {A: 2} and applier.counts(A).unmapped == 1


def test_predictions_expire_only_on_event_fed_replicas() -> None:
    index = PrefixIndex(1000, predicted_ttl_s=10.0)
    applier = KvEventApplier(index, BS)
    applier.apply(A, [], now=0.0)  # A publishes events; B does not
    t, u = toks(2 * BS, 7), toks(2 * BS, 8)
    hashes, other = block_hashes(t, BS), block_hashes(u, BS)
    index.insert(hashes, A, now=1.0)
    index.insert(hashes, B, now=1.0)
    index.insert(other, A, now=1.0)
    applier.apply(A, [stored(u, engine_hashes(2, 40))], now=2.0)  # confirms `other` on A
    assert index.match(hashes, now=10.5) == {A: 2, B: 2}
    assert index.stats().predicted == 4 and index.stats().confirmed == 2
    assert index.match(hashes, now=11.5) == {B: 2}  # 1.0 + 10 s < 11.5: A's prediction expired
    assert index.match(other, now=100.0) == {A: 2}  # confirmed entries never expire
    assert index.stats().expired == 2
    index.check_integrity()


def test_a_repeated_prediction_restarts_its_clock() -> None:
    index = PrefixIndex(1000, predicted_ttl_s=10.0)
    index.set_event_fed(A)
    hashes = block_hashes(toks(BS, 9), BS)
    index.insert(hashes, A, now=0.0)
    index.insert(hashes, A, now=8.0)
    assert index.match(hashes, now=15.0) == {A: 1}
    assert index.match(hashes, now=18.5) == {}


def test_prediction_without_a_clock_takes_the_latest_time_seen() -> None:
    index = PrefixIndex(1000, predicted_ttl_s=10.0)
    index.set_event_fed(A)
    index.expire(100.0)
    hashes = block_hashes(toks(BS, 10), BS)
    index.insert(hashes, A)  # stamped 100.0
    assert index.match(hashes, now=109.0) == {A: 1}
    assert index.match(hashes, now=111.0) == {}


def test_engine_table_is_bounded(index) -> None:
    applier = KvEventApplier(index, BS, max_mapped=3)
    t = toks(5 * BS, 11)
    applier.apply(A, [stored(t, engine_hashes(5, 1))], now=0.0)
    assert applier.mapped(A) == 3
    applier.restarted(A)
    assert applier.mapped(A) == 0 and index.blocks_of(A) == 0


def test_confirm_and_lru_bound_hold_together() -> None:
    index = PrefixIndex(50, predicted_ttl_s=1.0)
    applier = KvEventApplier(index, BS)
    rng = random.Random(0)
    for i in range(300):
        t = toks(rng.randrange(1, 5) * BS, i)
        n = len(t) // BS
        applier.apply(rng.choice([A, B]), [stored(t, engine_hashes(n, i * 10))], now=float(i))
        index.insert(block_hashes(toks(BS * 2, -i), BS), A, now=float(i))
        assert len(index) <= 50
    index.check_integrity()
