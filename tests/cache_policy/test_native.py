"""The C extension (``cache_policy._native``) against the Python code it accelerates.

Generated inputs, valid and not: the hashes, bounds and errors are the same with the extension
and without it (``NATIVE`` set to None is the pure-Python path a machine without a compiler runs).
"""

from __future__ import annotations

from array import array
from contextlib import contextmanager

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cache_policy.hashing as hashing
import router.token_ids as token_ids
from cache_policy.hashing import BlockHasher, _hash_chain, _pack_tokens, block_hashes, chained_block_hashes
from cache_policy.native import NATIVE

@contextmanager
def without_native(module):
    """``module`` on its pure-Python path (``NATIVE`` None) inside the block."""
    saved, module.NATIVE = module.NATIVE, None
    try:
        yield
    finally:
        module.NATIVE = saved


needs_native = pytest.mark.skipif(NATIVE is None, reason="cache_policy._native is not built (no C compiler)")
"""On a machine without the extension, only test_the_extension_is_built fails (CI builds it)."""

U32 = st.integers(0, 2**32 - 1)
U64 = st.integers(0, 2**64 - 1)
ODD = st.one_of(st.integers(-2**70, -1), st.integers(2**32, 2**70), st.booleans(),
                st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=2), st.none())


def test_the_extension_is_built():
    # scripts/setup.sh builds it; CI must run the native path, not silently the fallback
    assert NATIVE is not None, "cache_policy._native is not built: run scripts/setup.sh"


@needs_native
@settings(max_examples=400, deadline=None)
@given(ids=st.lists(U32, max_size=200), block_size=st.integers(1, 20), parent=U64, seed=U64,
       salt=st.one_of(st.just(b""), st.binary(min_size=1, max_size=40)))
def test_hash_chain_is_the_python_chain(ids, block_size, parent, seed, salt):
    want = _hash_chain(_pack_tokens(ids), block_size, parent, salt, seed)
    assert NATIVE.hash_chain(ids, block_size, parent, salt, seed) == want
    assert NATIVE.hash_chain(tuple(ids), block_size, parent, salt, seed) == want
    # hash_packed: the same chain from IDs already packed, as bytes or as a TokenIds prompt's array
    assert NATIVE.hash_packed(_pack_tokens(ids), block_size, parent, salt, seed) == want
    packed = array(hashing._PACKED_U32, ids)
    assert NATIVE.hash_packed(packed, block_size, parent, salt, seed) == want
    assert hashing._chain(packed, block_size, parent, salt, seed) == want
    assert len(want) == len(ids) // block_size


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.one_of(U32, ODD), min_size=1, max_size=40), block_size=st.integers(1, 8),
       salt=st.one_of(st.none(), st.text(min_size=1, max_size=5)))
def test_block_hashes_answer_and_error_are_the_same_without_the_extension(ids, block_size, salt):
    def run():
        try:
            return block_hashes(ids, block_size, salt)
        except (ValueError, TypeError) as exc:
            return type(exc), str(exc)

    with_native = run()
    with without_native(hashing):
        assert run() == with_native


@needs_native
def test_ids_the_extension_declines_go_to_the_python_reference():
    # bool and numpy ints are ints to struct.pack (the reference) but not plain ints: None, then Python
    assert NATIVE.hash_chain([1, True, 3, 4], 2, 0, b"", 0) is None
    assert block_hashes([1, True, 3, 4], 2) == block_hashes([1, 1, 3, 4], 2)
    assert block_hashes(list(np.arange(8, dtype=np.int64)), 4) == block_hashes(list(range(8)), 4)
    for bad in (-1, 2**32, 2**100):
        assert NATIVE.hash_chain([5, 6, bad], 2, 0, b"", 0) is None  # the partial tail is checked too
        with pytest.raises(ValueError, match="token_ids must be integers"):
            block_hashes([5, 6, bad], 2)
    with pytest.raises(ValueError, match="block_size"):
        NATIVE.hash_chain([1], 0, 0, b"", 0)
    with pytest.raises(TypeError):
        NATIVE.hash_chain(iter([1, 2]), 1, 0, b"", 0)


@settings(max_examples=200, deadline=None)
@given(head=st.lists(U32, max_size=50), tail=st.lists(U32, max_size=50), block_size=st.integers(1, 9))
def test_a_chain_continued_from_a_parent_and_the_incremental_hasher_agree(head, tail, block_size):
    whole = block_hashes(head + tail, block_size)
    cut = len(head) // block_size * block_size
    first = block_hashes(head[:cut], block_size)
    assert first + chained_block_hashes(first[-1] if first else None, head[cut:] + tail, block_size) == whole
    hasher = BlockHasher(block_size)
    hasher.extend(head)
    hasher.extend(tail)
    assert list(hasher.hashes) == whole


@needs_native
@settings(max_examples=400, deadline=None)
@given(ids=st.lists(st.one_of(st.integers(-2**63, 2**63 - 1), ODD), max_size=30))
def test_int_bounds_is_min_max_of_plain_ints_or_none(ids):
    plain = bool(ids) and all(type(t) is int and -2**63 <= t < 2**63 for t in ids)
    assert NATIVE.int_bounds(ids) == ((min(ids), max(ids)) if plain else None)


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.one_of(st.integers(-2**40, 2**40), ODD), min_size=1, max_size=30))
def test_the_routers_id_checks_are_the_same_without_the_extension(ids):
    def run():
        ints = token_ids.all_ints(ids)
        return ints, token_ids.min_max(ids) if ints else None, token_ids.int_bounds(ids)

    with_native = run()
    with without_native(token_ids):
        assert run() == with_native
    assert with_native[0] == all(type(t) is int for t in ids)
    assert with_native[2] == ((min(ids), max(ids)) if with_native[0] else None)


@needs_native
def test_hash_packed_refuses_a_partial_token():
    with pytest.raises(ValueError, match="whole number of uint32"):
        NATIVE.hash_packed(b"\x01\x02\x03", 4, 0, b"", 0)
    with pytest.raises(ValueError, match="block_size"):
        NATIVE.hash_packed(b"", 0, 0, b"", 0)


# -- the decision core's per-block walks on a prefix-cache hit ----------------------------------

REPLICAS = st.sampled_from(["r0", "r1", "r2"])
ENTRY = st.one_of(REPLICAS, st.dictionaries(REPLICAS, st.one_of(st.none(), st.floats(0, 10)), min_size=1))


@needs_native
@settings(max_examples=400, deadline=None)
@given(entries=st.dictionaries(st.integers(0, 40), ENTRY), hashes=st.lists(st.integers(0, 40), max_size=30),
       start=st.integers(-2, 32), replica=REPLICAS)
def test_held_run_is_the_python_walk(entries, hashes, start, replica):
    from cache_policy.prefix_index import _held_run_py

    # the reference, written out again: the first block from start whose entry does not name replica
    want = next((i for i in range(max(start, 0), len(hashes))
                 if not (entries.get(hashes[i]) == replica or replica in (entries.get(hashes[i]) or ()))),
                len(hashes))
    assert _held_run_py(entries, hashes, start, replica) == want
    assert NATIVE.held_run(entries, tuple(hashes), start, replica) == want
    assert NATIVE.held_run(entries, tuple(hashes), start, "r" + replica[1:]) == want  # equal, not identical


@needs_native
@settings(max_examples=400, deadline=None)
@given(refs=st.dictionaries(st.integers(0, 30), st.integers(1, 3)),
       stamps=st.dictionaries(st.integers(0, 30), st.integers(0, 60)),
       old=st.dictionaries(st.integers(0, 30), st.integers(0, 60)),
       hashes=st.lists(st.integers(0, 30), max_size=30), matched=st.integers(0, 35),
       extra=st.integers(0, 10), free_final=st.integers(-5, 70),
       lows=st.lists(st.tuples(st.integers(0, 70), st.integers(-10, 70)), max_size=6))
def test_surviving_run_is_the_python_walk(refs, stamps, old, hashes, matched, extra, free_final, lows):
    from collections import Counter

    from cache_policy.free_queue import FreeQueueModel, _ReplicaQueue, _surviving_py

    freed = max([*stamps.values(), *old.values(), 0]) + extra
    q = _ReplicaQueue(Counter(refs), stamps, old, 0)
    model = FreeQueueModel()
    model._replicas["r0"] = q
    for at, low_free in sorted(lows):  # past low points as FreeQueueModel.note records them (suffix maxima)
        q.freed = max(q.freed, at)
        model.note("r0", low_free, 10_000)
    q.freed = max(q.freed, freed)
    want = _surviving_py(q, hashes, matched, free_final)
    assert NATIVE.surviving_run(q.refs, stamps, old, tuple(hashes), matched, q.freed, free_final,
                                q.low_freed, q.low_bound) == want
    assert model.surviving("r0", tuple(hashes), matched, free_final) == want  # the path the core takes
    if not q.low_freed:
        assert NATIVE.surviving_run(q.refs, stamps, old, tuple(hashes), matched, q.freed, free_final) == want
    assert 0 <= want <= min(matched, len(hashes))


@needs_native
def test_surviving_run_refuses_low_points_that_do_not_pair():
    with pytest.raises(ValueError, match="low_freed and low_bound differ in length"):
        NATIVE.surviving_run({}, {}, {}, (1,), 1, 5, 5, [1, 2], [3])
    with pytest.raises(TypeError, match="a low point is not an int"):
        NATIVE.surviving_run({}, {}, {}, (1,), 1, 5, 5, [1.5], [3])


def test_the_walks_on_a_hit_answer_alike_with_and_without_the_extension():
    """One decision core, agent turns that extend their prompt: the same placements and expected
    hits on the C walks and on the Python ones."""
    import random

    import cache_policy.free_queue as free_queue
    import cache_policy.prefix_index as prefix_index
    from cache_policy.config import PolicyConfig
    from cache_policy.core import DecisionCore, RequestSpec

    def run() -> list[tuple[str, int, int]]:
        rng = random.Random(7)
        core = DecisionCore(PolicyConfig())
        for r in range(3):
            core.add_replica(f"r{r}", block_size=16, num_gpu_blocks=2000)
        sessions = [[rng.randrange(100, 30000) for _ in range(400)] for _ in range(5)]
        out, t = [], 0.0
        for turn in range(12):
            for k, ids in enumerate(sessions):
                ids.extend(rng.randrange(100, 30000) for _ in range(rng.randrange(10, 60)))
                t += 0.01
                job = core.open(RequestSpec(list(ids), f"s{k}", new_tokens=20), t)
                core.place(job, t)
                core.admit(job, t)
                core.settle()
                out.append((job.replica_id, job.decision.matched_blocks, job.expected_cached_tokens))
                job.generated_tokens = 20
                core.finish(job, "ok", t)
        return out

    with_c = run()
    with without_native(prefix_index), without_native(free_queue):
        without = run()
    assert with_c == without
    assert sum(m for _, m, _ in with_c) > 0 and sum(e for _, _, e in with_c) > 0  # hits happened


@needs_native
@settings(max_examples=300, deadline=None)
@given(refs=st.dictionaries(st.integers(0, 30), st.integers(1, 3)),
       stamps=st.dictionaries(st.integers(0, 30), st.integers(0, 60)),
       old=st.dictionaries(st.integers(0, 30), st.integers(0, 60)),
       hashes=st.lists(st.integers(0, 30), max_size=30))
def test_taken_run_is_the_python_walk(refs, stamps, old, hashes):
    from collections import Counter

    from cache_policy.free_queue import _ReplicaQueue, _taken_py

    q = _ReplicaQueue(Counter(refs), stamps, old, 100)
    want = _taken_py(q, hashes)
    assert NATIVE.taken_run(q.refs, stamps, old, tuple(hashes)) == want


# an index operation: insert (a prompt's hashes on a replica), confirm (an engine event), remove
INDEX_OPS = st.lists(st.tuples(st.sampled_from(["insert", "insert", "insert", "confirm", "remove"]),
                               st.lists(st.integers(0, 25), min_size=1, max_size=12).map(tuple),
                               st.sampled_from(["r0", "r1", "r2"])), max_size=25)


@needs_native
@settings(max_examples=300, deadline=None)
@given(ops=INDEX_OPS, fed=st.sampled_from([(), ("r1",)]), max_blocks=st.integers(4, 40))
def test_the_index_inserts_alike_with_and_without_the_extension(ops, fed, max_blocks):
    """insert_run (a hit's blocks a replica holds alone, in C) leaves the index exactly as the
    Python loop does: the same entries in the same LRU order, the same counts."""
    import cache_policy.prefix_index as prefix_index
    from cache_policy.prefix_index import PrefixIndex

    def run() -> tuple:
        index = PrefixIndex(max_blocks, evict_batch=1)
        for r in fed:
            index.set_event_fed(r, now=0.0)
        for t, (op, hashes, replica) in enumerate(ops):
            if op == "insert":
                index.insert(hashes, replica, float(t))
            elif op == "confirm":
                index.confirm(hashes, replica, float(t))
            else:
                index.remove(hashes, replica)
        index.check_integrity()
        return list(index._entries.items()), dict(index._per_replica), dict(index._confirmed), len(index)

    with_c = run()
    with without_native(prefix_index):
        assert run() == with_c


@needs_native
def test_the_walks_take_only_what_cannot_change_under_them():
    """A fresh attacker crashed the walks: a list resized by a key's ``__eq__`` mid-walk, and a
    ``str`` subclass whose ``__eq__`` freed the entry ``insert_run`` was comparing. They take a
    tuple of hashes (the Python wrappers send anything else down the Python loop) and
    ``insert_run`` an exact ``str``; a key that empties the dict mid-walk is survived."""
    for call in (lambda h: NATIVE.held_run({}, h, 0, "r0"), lambda h: NATIVE.surviving_run({}, {}, {}, h, 1, 0, 0),
                 lambda h: NATIVE.taken_run({}, {}, {}, h), lambda h: NATIVE.insert_run({}, h, "r0")):
        with pytest.raises(TypeError, match="tuple"):
            call([1, 2])

    class Sneaky(str):
        def __eq__(self, other):
            entries.clear()
            return str.__eq__(self, other)

        __hash__ = str.__hash__

    entries = {1: "r0", 2: "r0"}
    with pytest.raises(TypeError, match="str"):
        NATIVE.insert_run(entries, (1, 2), Sneaky("r0"))

    class Clearing(int):
        """A block hash whose comparison empties the dict being walked."""

        def __eq__(self, other):
            entries.clear()
            return int.__eq__(self, other)

        __hash__ = int.__hash__

    entries = {Clearing(5): "r0", 6: "r0"}
    assert NATIVE.held_run(entries, (Clearing(5), 6), 0, Sneaky("r0")) in (0, 1, 2)  # no crash, an answer
    entries = {Clearing(5): "r0"}
    assert NATIVE.insert_run(entries, (Clearing(5), 6), "r0")[0] >= -1
