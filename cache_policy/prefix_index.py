"""PrefixIndex: which replicas the router believes hold which blocks.

The router cannot see a replica's cache; it remembers where it sent each prefix (as
SGLang's approximate radix tree and Ray Serve's ``PrefixTree`` do). Entries are keyed by
chained block hash, so a hash identifies its whole prefix and no tree is needed.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence

from cache_policy.types import BlockHash, ReplicaId


class PrefixIndex:
    """Block hash -> set of replicas believed to hold that block, bounded, LRU.

    Invariants (``check_integrity``):

    * ``len(self) <= max_blocks`` (one entry per distinct hash, whatever its replicas);
    * no entry has an empty replica set;
    * ``_per_replica[r]`` == number of entries whose set contains ``r``.

    Order: ``_entries`` runs from least to most recently used. ``insert`` and ``match``
    touch a prefix's hashes from its last block to its first, so block 0 is the most
    recently used and a prefix is evicted from its tail first (as vLLM frees blocks in
    reverse order): a chain never loses its head while keeping its tail.
    Eviction drops whole entries (all replicas) from the least recently used end.
    """

    def __init__(self, max_blocks: int) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks (max_index_blocks) must be >= 1, got {max_blocks}")
        self.max_blocks = max_blocks
        self._entries: OrderedDict[BlockHash, set[ReplicaId]] = OrderedDict()
        self._per_replica: Counter[ReplicaId] = Counter()

    def __len__(self) -> int:
        return len(self._entries)

    def replicas(self) -> set[ReplicaId]:
        """Replicas holding at least one indexed block."""
        return {r for r, n in self._per_replica.items() if n > 0}

    def blocks_of(self, replica: ReplicaId) -> int:
        """Number of indexed blocks ``replica`` holds (an approximate cache size)."""
        return self._per_replica[replica]

    def insert(self, hashes: Sequence[BlockHash], replica: ReplicaId) -> None:
        """Record that ``replica`` now holds every block of ``hashes``; evict past capacity."""
        for h in reversed(hashes):
            holders = self._entries.get(h)
            if holders is None:
                holders = self._entries[h] = set()
            else:
                self._entries.move_to_end(h)
            if replica not in holders:
                holders.add(replica)
                self._per_replica[replica] += 1
        self._evict()

    def match(self, hashes: Sequence[BlockHash]) -> dict[ReplicaId, int]:
        """Leading blocks of ``hashes`` each replica holds, contiguous from block 0.

        Replicas holding none of the leading blocks are absent from the result. Touches
        the matched hashes (refreshes their LRU position).
        """
        result: dict[ReplicaId, int] = {}
        alive: set[ReplicaId] = set()
        for depth, h in enumerate(hashes):
            holders = self._entries.get(h)
            if holders is None:
                break
            alive = set(holders) if depth == 0 else alive & holders
            if not alive:
                break
            for r in alive:
                result[r] = depth + 1
        self._touch(hashes[: max(result.values(), default=0)])
        return result

    def remove(self, hashes: Sequence[BlockHash], replica: ReplicaId) -> None:
        """Forget that ``replica`` holds ``hashes`` (e.g. blocks of a request it rejected)."""
        for h in hashes:
            holders = self._entries.get(h)
            if holders is None or replica not in holders:
                continue
            holders.discard(replica)
            if not holders:
                del self._entries[h]
            self._per_replica[replica] -= 1
            if self._per_replica[replica] == 0:
                del self._per_replica[replica]

    def remove_replica(self, replica: ReplicaId) -> None:
        """Forget every block ``replica`` holds (it left the fleet or lost its cache)."""
        if not self._per_replica.get(replica):
            return
        for h in list(self._entries):
            holders = self._entries[h]
            holders.discard(replica)
            if not holders:
                del self._entries[h]
        del self._per_replica[replica]

    def clear(self) -> None:
        """Forget everything (e.g. after a cache flush on every replica)."""
        self._entries.clear()
        self._per_replica.clear()

    def check_integrity(self) -> None:
        """Raise ``RuntimeError('bug: ...')`` if an invariant of the class is broken."""
        if len(self._entries) > self.max_blocks:
            raise RuntimeError(f"bug: index holds {len(self._entries)} > {self.max_blocks}")
        counts: Counter[ReplicaId] = Counter()
        for h, holders in self._entries.items():
            if not holders:
                raise RuntimeError(f"bug: empty replica set for block {h:#x}")
            counts.update(holders)
        if +counts != +self._per_replica:
            raise RuntimeError(
                f"bug: per-replica counts {dict(self._per_replica)} != {dict(counts)}"
            )

    def _touch(self, hashes: Iterable[BlockHash]) -> None:
        for h in reversed(list(hashes)):
            self._entries.move_to_end(h)

    def _evict(self) -> None:
        while len(self._entries) > self.max_blocks:
            _, holders = self._entries.popitem(last=False)
            for r in holders:
                self._per_replica[r] -= 1
                if self._per_replica[r] == 0:
                    del self._per_replica[r]
