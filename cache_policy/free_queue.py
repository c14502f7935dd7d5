"""FreeQueueModel: which cached blocks will still be there when a request reaches the engine.

A prefix the index holds (confirmed by a KV event or predicted) is a hit only if the engine
has not evicted it by the time the request is scheduled. vLLM keeps every block no running
request references in one free queue (``vllm/v1/core/kv_cache_utils.py``
``FreeKVCacheBlockQueue``): a finished request's blocks are appended to its tail in reverse
order (``block_pool.free_blocks`` over ``reversed(req_blocks)``: output tail first, block 0
last), a hit takes a block out of it (``touch``), and every new block is taken from its head,
evicting the cached block there. A request touches its own hits before it allocates
(``KVCacheManager.allocate_slots``), so only the work scheduled before it can evict them.

The model, per replica, from the router's own requests alone (no I/O):

* ``refs``: block hash -> requests in flight that hold it (never evicted while > 0);
* ``freed``: a counter of blocks appended to the free queue's tail (each finished request adds
  its full blocks: prompt + the tokens it generated, or its max tokens when unknown);
* ``stamps``: per released block, the counter just before the blocks appended after it, so
  ``freed - stamp`` bounds from above how many free blocks are as new as it or newer (its
  rank from the tail). An output block has no hash here, but the next turn's prompt holds it
  right after the last prompt block: it takes the stamp before it minus one. Kept in two
  generations: once the current one holds twice the replica's capacity it becomes the old one
  and the one before is dropped whole, every stamp in it being more than a cache of releases
  old (a block whose rank bound passes the capacity counts as evicted anyway). That costs a
  dict's deallocation every few dozen requests instead of a pass over every stamp.

If every request in flight reaches its peak, ``free_final`` blocks stay free (``capacity -
committed``); evictions take the oldest, so a free block survives if its rank from the tail
is at most ``free_final`` (:meth:`surviving`). Both bounds err toward predicting a miss: the
model may under-predict a hit (recall) but predicts one only when the engine will have it
(precision), which is what admission and the expected-cached count need.
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from cache_policy.native import NATIVE
from cache_policy.types import BlockHash, ReplicaId


@dataclass
class _ReplicaQueue:
    refs: Counter[BlockHash] = field(default_factory=Counter)
    stamps: dict[BlockHash, int] = field(default_factory=dict)
    """The current generation of release stamps (:meth:`stamp` reads both)."""
    old: dict[BlockHash, int] = field(default_factory=dict)
    """The generation before: read where ``stamps`` has no entry."""
    freed: int = 0
    low_freed: list[int] = field(default_factory=list)
    """With :attr:`low_bound`: the free queue's past low points (:meth:`FreeQueueModel.note`),
    ``low_freed`` the counter when each was recorded (nondecreasing) and ``low_bound`` the least
    stamp a block released before it needed to survive it; kept as suffix maxima (``low_bound``
    strictly decreasing), so one bisection answers for every low point since a block's release."""
    low_bound: list[int] = field(default_factory=list)

    def evicted_before(self, stamp: int) -> bool:
        """Whether a block released at ``stamp`` may have been evicted at a low point since."""
        i = bisect.bisect_right(self.low_freed, stamp)
        return i < len(self.low_bound) and stamp < self.low_bound[i]

    def stamp(self, h: BlockHash) -> int | None:
        """The release stamp of ``h`` (None: never released here, or forgotten)."""
        stamp = self.stamps.get(h)
        return self.old.get(h) if stamp is None else stamp

    def all_stamps(self) -> dict[BlockHash, int]:
        """Every stamp remembered, one per block (the newer generation's)."""
        return {**self.old, **self.stamps}


class FreeQueueModel:
    """Per replica: blocks held by requests in flight and the release order of the rest.

    Invariants: ``refs`` values are > 0; no stamp is above ``freed``. Stamps are forgotten a
    generation at a time (module doc): a block whose rank bound exceeds the capacity could
    never be counted by :meth:`surviving`. About 1 us per prompt block.
    """

    def __init__(self) -> None:
        self._replicas: dict[ReplicaId, _ReplicaQueue] = {}

    def sizes(self) -> dict[str, int]:
        """Entries held over all replicas: ``held_blocks`` (prompt blocks of requests in flight)
        and ``free_stamps`` (release stamps of free blocks: two generations, each cut at twice
        the replica's capacity, ``_trim``) and ``low_points`` (past low points, :meth:`note`)."""
        return {"held_blocks": sum(len(q.refs) for q in self._replicas.values()),
                "free_stamps": sum(len(q.stamps) + len(q.old) for q in self._replicas.values()),
                "low_points": sum(len(q.low_freed) for q in self._replicas.values())}

    def hold(self, rid: ReplicaId, hashes: Sequence[BlockHash]) -> list[int]:
        """A request with prompt blocks ``hashes`` was dispatched to ``rid``: they leave the free
        queue. Returns the stamps of those its prefix-cache hit takes out of it (a hit taken from the
        queue makes every older free block's rank from the tail one smaller; see
        ``AdmissionState.parked_guard``): the leading blocks, up to the first one neither held nor
        free (vLLM's hit stops there, ``KVCacheManager.get_computed_blocks``; a later block with a
        cached twin is allocated anew and leaves the twin in the queue). A new prompt costs one
        lookup here, not one per block."""
        q = self._replicas.get(rid)
        if q is None:
            q = self._replicas[rid] = _ReplicaQueue()
        if NATIVE is not None and hashes.__class__ is tuple:
            taken = NATIVE.taken_run(q.refs, q.stamps, q.old, hashes)
        else:
            taken = _taken_py(q, hashes)
        q.refs.update(hashes)
        return taken

    def release(self, rid: ReplicaId, hashes: Sequence[BlockHash], footprint_blocks: int, capacity_blocks: int,
                *, prefilled: bool = True) -> None:
        """The request holding ``hashes`` on ``rid`` ended. ``footprint_blocks``: the full blocks
        of its prompt and output (at most; a partial block goes to the queue's head, evicted
        first, and does not count); ``capacity_blocks``: the replica's KV cache size. ``prefilled=False`` (refused, never reached the engine): the holds go,
        nothing was appended to the free queue."""
        q = self._replicas.get(rid)
        if q is None:
            return
        refs, stamps = q.refs, q.stamps
        # appended: the output blocks, then block n-1 ... block 0 (those no other request holds);
        # block i's stamp is the counter before it plus the freed blocks after it in the request
        base = q.freed + max(0, footprint_blocks - len(hashes))
        if hashes and max(map(refs.__getitem__, hashes)) == 1:  # no other request holds any (C-speed)
            deque(map(refs.pop, hashes, itertools.repeat(None)), 0)  # a hash held by none: no refs
            if prefilled:
                stamps.update(zip(reversed(hashes), range(base, base + len(hashes))))
                q.freed = base + len(hashes)
                self._trim(q, capacity_blocks)
            return
        c = 0
        for h in reversed(hashes):
            n = refs.get(h, 0)
            if n > 1:
                refs[h] = n - 1
                continue
            if n:
                refs.pop(h)  # dict.pop: Counter's __delitem__ is Python
            if prefilled:
                stamps[h] = base + c
                c += 1
        if prefilled:
            q.freed = base + c
            self._trim(q, capacity_blocks)

    def note(self, rid: ReplicaId, low_free: int, capacity_blocks: int) -> None:
        """A request on ``rid`` is about to release its blocks: just before, the free queue was at
        its lowest since the last release (nothing frees blocks in between; the engine only
        allocates), with at least ``low_free`` blocks (the request's own blocks as it used them,
        every other one in flight at its peak). A free block whose rank bound ``freed - stamp``
        exceeded that was evicted then, and stays evicted however many blocks later releases
        leave free: :meth:`surviving` checks each such past low point, not only the present one.
        (A CI run and a traced vLLM engine: a session's block evicted while three requests ran,
        then counted as a hit once one of them ended and the free count rose past its rank.)"""
        q = self._replicas.get(rid)
        if q is None:
            return
        bound = q.freed - low_free
        lf, lb = q.low_freed, q.low_bound
        while lb and lb[-1] <= bound:
            lb.pop()
            lf.pop()
        lf.append(q.freed)
        lb.append(bound)
        # a block released before freed - capacity fails the present check anyway: older points never decide
        k = bisect.bisect_right(lf, q.freed - max(capacity_blocks, 1))
        if k:
            del lf[:k], lb[:k]

    @staticmethod
    def _trim(q: _ReplicaQueue, capacity_blocks: int) -> None:
        """Start a new generation of stamps when the current one holds twice the capacity: the
        one before it is dropped whole (bounded memory). Every stamp in it was made before the
        current generation's first, more than ``2 * capacity`` releases ago (each stamp the current
        one holds adds at least one to ``freed``), so its rank bound passes the capacity."""
        if len(q.stamps) > 2 * max(capacity_blocks, 16):
            q.old, q.stamps = q.stamps, {}

    def surviving(self, rid: ReplicaId, hashes: Sequence[BlockHash], matched: int, free_final: int) -> int:
        """Of ``hashes[:matched]`` (blocks the index says ``rid`` holds), how many leading blocks
        the engine will still hold when this request is scheduled, if ``free_final`` blocks stay
        free once the requests in flight reach their peak. A block of unknown release (another
        router's, or from before this router started) counts as a miss."""
        q = self._replicas.get(rid)
        if q is None:
            return 0
        if NATIVE is not None and hashes.__class__ is tuple:  # one C pass: a hit is ~250 blocks
            return NATIVE.surviving_run(q.refs, q.stamps, q.old, hashes, matched, q.freed, free_final,
                                        q.low_freed, q.low_bound)
        return _surviving_py(q, hashes, matched, free_final)

    def freed(self, rid: ReplicaId) -> int | None:
        """Blocks appended to ``rid``'s free queue so far (None: nothing dispatched there yet)."""
        q = self._replicas.get(rid)
        return q.freed if q is not None else None

    def held(self, rid: ReplicaId) -> int:
        """Distinct blocks requests in flight hold on ``rid``."""
        q = self._replicas.get(rid)
        return len(q.refs) if q is not None else 0

    def reset(self, rid: ReplicaId) -> None:
        """``rid``'s cache was emptied (reset, restart, AllBlocksCleared): forget its free blocks;
        requests still in flight keep their holds."""
        q = self._replicas.get(rid)
        if q is not None:
            q.stamps.clear()
            q.old.clear()
            q.low_freed.clear()
            q.low_bound.clear()

    def remove_replica(self, rid: ReplicaId) -> None:
        """``rid`` left the fleet."""
        self._replicas.pop(rid, None)

    def check_integrity(self) -> None:
        """Raise ``RuntimeError('bug: ...')`` if an invariant is broken."""
        for rid, q in self._replicas.items():
            if any(n <= 0 for n in q.refs.values()):
                raise RuntimeError(f"bug: a non-positive hold count on {rid}")
            if any(s > q.freed for s in itertools.chain(q.stamps.values(), q.old.values())):
                raise RuntimeError(f"bug: a free-queue stamp of {rid} above its counter")
            if (len(q.low_freed) != len(q.low_bound) or q.low_freed != sorted(q.low_freed)
                    or any(a <= b for a, b in zip(q.low_bound, q.low_bound[1:]))):
                raise RuntimeError(f"bug: the low points of {rid} are not suffix maxima")


def _surviving_py(q: _ReplicaQueue, hashes: Sequence[BlockHash], matched: int, free_final: int) -> int:
    """:meth:`FreeQueueModel.surviving` past its replica lookup: the reference of
    ``cache_policy._native.surviving_run``."""
    refs, stamp_of, freed = q.refs, q.stamp, q.freed
    prev: int | None = None
    for n in range(min(matched, len(hashes))):
        h = hashes[n]
        if h in refs:
            prev = None
            continue
        stamp = stamp_of(h)
        if stamp is None and prev is not None:
            stamp = prev - 1  # an output block of the request that released the one before
        if stamp is None or freed - stamp > free_final or q.evicted_before(stamp):
            return n
        prev = stamp
    return min(matched, len(hashes))


def _taken_py(q: _ReplicaQueue, hashes: Sequence[BlockHash]) -> list[int]:
    """The stamps :meth:`FreeQueueModel.hold` returns: the reference of ``cache_policy._native.taken_run``."""
    refs, stamp_of = q.refs, q.stamp
    taken = []
    for h in hashes:
        if h in refs:
            continue
        stamp = stamp_of(h)
        if stamp is None:
            break
        taken.append(stamp)
    return taken
