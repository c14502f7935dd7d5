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
* ``freed``: a counter of blocks appended to the free queue (each finished request adds its
  footprint: prompt + max tokens, an upper bound of what the engine frees);
* ``stamps``: per released block, ``freed`` at its release minus its index in the request,
  so ``freed - stamp`` bounds from above how many free blocks are newer than it (its rank
  from the tail, itself included). An output block has no hash here, but the next turn's
  prompt holds it right after the last prompt block: it takes the stamp before it minus one.

If every request in flight reaches its peak, ``free_final`` blocks stay free (``capacity -
committed``); evictions take the oldest, so a free block survives if its rank from the tail
is at most ``free_final`` (:meth:`surviving`). Both bounds err toward predicting a miss: the
model may under-predict a hit (recall) but predicts one only when the engine will have it
(precision), which is what admission and the expected-cached count need.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from cache_policy.types import BlockHash, ReplicaId


@dataclass
class _ReplicaQueue:
    refs: dict[BlockHash, int] = field(default_factory=dict)
    stamps: OrderedDict[BlockHash, int] = field(default_factory=OrderedDict)
    freed: int = 0


class FreeQueueModel:
    """Per replica: blocks held by requests in flight and the release order of the rest.

    Invariants: ``refs`` values are > 0; ``stamps`` is ordered by stamp (oldest first). A
    release prunes blocks whose rank bound exceeds the replica's capacity: :meth:`surviving`
    could never count them.
    """

    def __init__(self) -> None:
        self._replicas: dict[ReplicaId, _ReplicaQueue] = {}

    def hold(self, rid: ReplicaId, hashes: Sequence[BlockHash]) -> None:
        """A request with prompt blocks ``hashes`` was dispatched to ``rid``: they leave the free queue."""
        q = self._replicas.setdefault(rid, _ReplicaQueue())
        refs = q.refs
        for h in hashes:
            refs[h] = refs.get(h, 0) + 1

    def release(self, rid: ReplicaId, hashes: Sequence[BlockHash], footprint_blocks: int, capacity_blocks: int,
                *, prefilled: bool = True) -> None:
        """The request holding ``hashes`` on ``rid`` ended. ``footprint_blocks``: every block it
        may have had at its peak (prompt + max tokens); ``capacity_blocks``: the replica's KV
        cache size. ``prefilled=False`` (refused, never reached the engine): the holds go,
        nothing was appended to the free queue."""
        q = self._replicas.get(rid)
        if q is None:
            return
        refs, stamps = q.refs, q.stamps
        freed = []
        for h in hashes:
            n = refs.get(h, 0) - 1
            if n > 0:
                refs[h] = n
            else:
                refs.pop(h, None)
                freed.append(h)
        if not prefilled:
            return
        q.freed += max(0, footprint_blocks - len(hashes)) + len(freed)  # output blocks, then the prompt's
        rank = len(freed)  # block i's rank from the tail: 1 + the freed blocks before it
        for i in range(len(hashes) - 1, -1, -1):
            h = hashes[i]
            if h not in refs:
                stamps[h] = q.freed - rank
                stamps.move_to_end(h)
                rank -= 1
        self._prune(q, capacity_blocks)

    def surviving(self, rid: ReplicaId, hashes: Sequence[BlockHash], matched: int, free_final: int) -> int:
        """Of ``hashes[:matched]`` (blocks the index says ``rid`` holds), how many leading blocks
        the engine will still hold when this request is scheduled, if ``free_final`` blocks stay
        free once the requests in flight reach their peak. A block of unknown release (another
        router's, or from before this router started) counts as a miss."""
        q = self._replicas.get(rid)
        if q is None:
            return 0
        refs, stamps, freed = q.refs, q.stamps, q.freed
        prev: int | None = None
        for n in range(matched):
            h = hashes[n]
            if h in refs:
                prev = None
                continue
            stamp = stamps.get(h)
            if stamp is None and prev is not None:
                stamp = prev - 1  # an output block of the request that released the one before
            if stamp is None or freed - stamp > free_final:
                return n
            prev = stamp
        return matched

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

    def remove_replica(self, rid: ReplicaId) -> None:
        """``rid`` left the fleet."""
        self._replicas.pop(rid, None)

    def check_integrity(self) -> None:
        """Raise ``RuntimeError('bug: ...')`` if an invariant is broken."""
        for rid, q in self._replicas.items():
            if any(n <= 0 for n in q.refs.values()):
                raise RuntimeError(f"bug: a non-positive hold count on {rid}")
            stamps = list(q.stamps.values())
            if stamps != sorted(stamps):
                raise RuntimeError(f"bug: free-queue stamps of {rid} out of order")

    @staticmethod
    def _prune(q: _ReplicaQueue, capacity_blocks: int) -> None:
        stamps, oldest = q.stamps, q.freed - max(capacity_blocks, 1)
        while stamps and next(iter(stamps.values())) < oldest:
            stamps.popitem(last=False)
