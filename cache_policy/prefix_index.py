"""PrefixIndex: which replicas the router believes hold which blocks, predicted or confirmed.

The router remembers where it sent each prefix (as SGLang's approximate radix tree and Ray
Serve's ``PrefixTree`` do): a *predicted* entry, added at once by a routing decision, so a
GRPO group's later members see the first member's placement before any engine reports it.
Replicas that publish vLLM KV events also *confirm* entries (``BlockStored``) and remove
them (``BlockRemoved``, ``AllBlocksCleared``; see ``cache_policy.kv_events``); on such an
*event-fed* replica a predicted entry that no event confirms within ``predicted_ttl_s``
expires. A replica without events keeps predicted entries until LRU eviction or removal.
Entries are keyed by chained block hash, so a hash identifies its whole prefix and no tree
is needed. Times are float seconds from the caller's clock; the index remembers the latest
``now`` it was given and stamps predictions made without one with it.

Most blocks have one holder, a prediction on a replica without events: such an entry is that
replica's id itself (a ``str``, shared, not tracked by the garbage collector) instead of a
``{replica: stamp}`` dict (whose stamp nothing would read). A 4,000-token prompt then adds no
object per block, and the cyclic garbage collector no longer walks 200,000 dicts: in the router
(``bench.h2h.ab``) full collections took 67 ms each, about 0.18 ms per request.
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass

from cache_policy.native import NATIVE
from cache_policy.types import BlockHash, ReplicaId

_CONFIRMED = None
"""State of a (block, replica) pair an engine event confirmed; a float is a prediction time."""

def _as_dict(holders) -> dict[ReplicaId, float | None]:
    """``holders`` as a ``{replica: state}`` dict (a single holder's stamp is never read: 0.0)."""
    return {holders: 0.0} if holders.__class__ is str else holders


def _held_by(holders, replica: ReplicaId) -> bool:
    return holders == replica if holders.__class__ is str else replica in holders


def _held_run_py(entries: dict, hashes: Sequence[BlockHash], start: int, replica: ReplicaId) -> int:
    """The first index ``i >= start`` of ``hashes`` whose entry is missing or does not name
    ``replica`` (``len(hashes)`` when none): the reference of ``cache_policy._native.held_run``,
    which a 4,000-token prompt's hit (250 blocks) takes in a few microseconds instead of ~100."""
    for i in range(max(start, 0), len(hashes)):
        holders = entries.get(hashes[i])
        if holders is None or not _held_by(holders, replica):
            return i
    return len(hashes)


def _held_run(entries: dict, hashes: Sequence[BlockHash], start: int, replica: ReplicaId) -> int:
    """:func:`_held_run_py`, in C when the extension is built and ``hashes`` is a tuple (a
    request's block hashes)."""
    if NATIVE is not None and hashes.__class__ is tuple:
        return NATIVE.held_run(entries, hashes, start, replica)
    return _held_run_py(entries, hashes, start, replica)


@dataclass(frozen=True)
class IndexStats:
    """Plain counters for metrics: ``entries`` distinct hashes; ``predicted`` and
    ``confirmed`` (block, replica) pairs now; ``expired`` predictions dropped so far."""

    entries: int
    predicted: int
    confirmed: int
    expired: int


class PrefixIndex:
    """Block hash -> replicas believed to hold that block (each predicted or confirmed), bounded, LRU.

    Invariants (``check_integrity``):

    * ``len(self) <= max_blocks`` (one entry per distinct hash, whatever its replicas);
    * no entry has an empty replica map; an entry that is a replica id (one holder, predicted)
      names a replica that is not event-fed;
    * ``_per_replica[r]`` == number of entries holding ``r``; ``_confirmed[r]`` == number of
      entries where ``r`` is confirmed.

    Order: ``_entries`` (a plain dict: a touched key is popped and put back) runs from least
    to most recently used. ``insert``, ``confirm`` and ``match`` touch a prefix's hashes from
    its last block to its first, so block 0 is the most recently used and a prefix is evicted
    from its tail first (as vLLM frees blocks in reverse order): a chain never loses its head
    while keeping its tail. Eviction drops whole entries (all replicas) from the least recently
    used end: once the index holds more than ``max_blocks``, down to ``max_blocks -
    evict_batch`` (default ``max_blocks // 64``), so a full index of 200,000 blocks evicts
    about every dozen new prompts, in one pass, and not 250 entries per prompt one by one.
    A plain dict costs one memory access per block where an ``OrderedDict`` costs two (its
    linked list): on a full index a 4,000-token prompt's insert and evictions went from about
    265 to 145 us.
    """

    def __init__(self, max_blocks: int, predicted_ttl_s: float = 10.0, *, evict_batch: int | None = None) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks (max_index_blocks) must be >= 1, got {max_blocks}")
        if not predicted_ttl_s > 0:
            raise ValueError(f"predicted_ttl_s must be > 0, got {predicted_ttl_s!r}")
        self.max_blocks = max_blocks
        self.predicted_ttl_s = predicted_ttl_s
        self.evict_batch = max_blocks // 64 if evict_batch is None else min(max(evict_batch, 0), max_blocks - 1)
        self._entries: dict[BlockHash, ReplicaId | dict[ReplicaId, float | None]] = {}
        self._per_replica: Counter[ReplicaId] = Counter()
        self._confirmed: Counter[ReplicaId] = Counter()
        self._event_fed: set[ReplicaId] = set()
        self._pending: deque[tuple[float, BlockHash, ReplicaId]] = deque()
        self._now = 0.0
        self._expired = 0
        self._deferred: list[tuple[Sequence[BlockHash], ReplicaId, float]] = []

    def __len__(self) -> int:
        self.settle()
        return len(self._entries)

    def sizes(self) -> dict[str, int]:
        """Entries held: ``index_blocks`` (at most ``max_blocks``) and ``index_predictions``
        (predicted entries awaiting a KV event or their ``predicted_ttl_s``)."""
        self.settle()
        return {"index_blocks": len(self._entries), "index_predictions": len(self._pending)}

    def replicas(self) -> set[ReplicaId]:
        """Replicas holding at least one indexed block."""
        self.settle()
        return {r for r, n in self._per_replica.items() if n > 0}

    def blocks_of(self, replica: ReplicaId) -> int:
        """Number of indexed blocks ``replica`` holds (an approximate cache size)."""
        self.settle()
        return self._per_replica[replica]

    def confirmed_of(self, replica: ReplicaId) -> int:
        """Number of ``replica``'s indexed blocks an engine event confirmed."""
        self.settle()
        return self._confirmed[replica]

    def set_event_fed(self, replica: ReplicaId, fed: bool = True, now: float | None = None) -> None:
        """Mark ``replica`` as publishing KV events (its predictions expire) or not. Its
        predictions made before it was fed expire ``predicted_ttl_s`` after ``now`` (default: the
        latest time the index was given), unless confirmed."""
        self.settle()
        self._clock(now)
        if not fed:
            self._event_fed.discard(replica)
            return
        if replica in self._event_fed:
            return
        self._event_fed.add(replica)
        if not self._per_replica.get(replica):
            return
        entries, stamp = self._entries, self._now if now is None else now
        for h, holders in list(entries.items()):
            if holders.__class__ is str:
                if holders == replica:
                    entries[h] = {replica: stamp}
                    self._pending.append((stamp, h, replica))
            elif holders.get(replica, _CONFIRMED) is not _CONFIRMED:
                holders[replica] = stamp
                self._pending.append((stamp, h, replica))
        self._compact_pending()

    def is_event_fed(self, replica: ReplicaId) -> bool:
        """True if ``replica``'s unconfirmed predictions expire after ``predicted_ttl_s``."""
        self.settle()
        return replica in self._event_fed

    def insert(self, hashes: Sequence[BlockHash], replica: ReplicaId, now: float | None = None, *,
               defer: bool = False) -> None:
        """Predict that ``replica`` now holds every block of ``hashes``; evict past capacity.

        A confirmed pair stays confirmed; a predicted one is stamped ``now`` again. ``defer``:
        only note the insert, stamped now; it is applied by :meth:`settle`, which every other
        method runs first, so no reader ever sees the index without it. A router decides, sends
        the request, then settles while the replica prefills: the insert of a 4,000-token prompt
        (250 blocks, and as many evicted from a full index) leaves the request's critical path.
        """
        self.settle()
        stamp = self._clock(now)
        if defer:
            self._deferred.append((hashes, replica, stamp))
            return
        fed = replica in self._event_fed
        compact = not fed and replica.__class__ is str  # the entry of a block it alone holds: its id
        entries, pending, added = self._entries, self._pending, 0
        if entries.keys().isdisjoint(hashes):  # a new prefix (C-speed test): one bulk insert
            before, last_first = len(entries), hashes[::-1]
            if not compact:
                entries.update(zip(last_first, [{replica: stamp} for _ in last_first]))
                if fed:
                    pending.extend([(stamp, h, replica) for h in last_first])
            else:  # the replica id itself: no object per block
                entries.update(zip(last_first, itertools.repeat(replica)))
            added = len(entries) - before  # not len(hashes): a hash repeated in ``hashes`` is one entry
            hashes = ()
        if hashes and compact and NATIVE is not None and hashes.__class__ is tuple:
            stop, new = NATIVE.insert_run(entries, hashes, replica)  # a hit's blocks it alone holds, in C,
            added += new  # up to the first block another replica holds too (the loop below goes on there)
            hashes = hashes[:stop + 1]
        pop = entries.pop
        for h in reversed(hashes):  # _holders inlined: this loop runs once per block of every request
            holders = pop(h, None)  # put back below: the most recently used end
            if holders is None:
                entries[h] = replica if compact else {replica: stamp}
                added += 1
            else:
                if holders.__class__ is str:
                    if holders == replica:
                        entries[h] = holders
                        continue  # not fed (the class invariant): nothing to stamp
                    holders = _as_dict(holders)
                entries[h] = holders
                state = holders.get(replica, stamp)
                if replica not in holders:
                    added += 1
                if state is _CONFIRMED:
                    continue
                holders[replica] = stamp
            if fed:
                pending.append((stamp, h, replica))
        if added:
            self._per_replica[replica] += added
        self._evict()
        self._compact_pending()

    def settle(self) -> None:
        """Apply the inserts :meth:`insert` deferred, in the order they were made."""
        while self._deferred:
            deferred, self._deferred = self._deferred, []
            for hashes, replica, stamp in deferred:
                self.insert(hashes, replica, stamp)

    def confirm(self, hashes: Sequence[BlockHash], replica: ReplicaId, now: float | None = None) -> None:
        """Record that ``replica``'s engine reported holding every block of ``hashes``."""
        self.settle()
        self._clock(now)
        for h in reversed(hashes):
            holders = self._holders(h)
            if replica not in holders:
                self._per_replica[replica] += 1
            if holders.get(replica, 0.0) is not _CONFIRMED:
                holders[replica] = _CONFIRMED
                self._confirmed[replica] += 1
        self._evict()

    def match(self, hashes: Sequence[BlockHash], now: float | None = None, *, touch: bool = True) -> dict[ReplicaId, int]:
        """Leading blocks of ``hashes`` each replica holds, contiguous from block 0.

        Expires stale predictions first (by ``now``, or by the latest time the index was
        given). Replicas holding none of the leading blocks are absent from the result.
        Touches the matched hashes (LRU) unless ``touch`` is False (a caller that inserts
        ``hashes`` next, which touches all of them: a routing decision).
        """
        self.settle()
        self.expire(self._clock(now))
        entries = self._entries
        first = entries.get(hashes[0]) if len(hashes) else None
        if not first:
            return {}
        # one pass over the blocks; a replica leaves ``alive`` at the first block it lacks (most
        # prefixes have one holder: then each block is one dict lookup and one membership test)
        result: dict[ReplicaId, int] = {}
        alive = [first] if first.__class__ is str else list(first)
        depth, n = 1, len(hashes)
        while depth < n:
            if len(alive) == 1:  # one holder left (most prefixes): the rest of its run in one call
                depth = _held_run(entries, hashes, depth, alive[0])
                break
            holders = entries.get(hashes[depth])
            if holders is None:
                break
            if holders.__class__ is str:
                holders = (holders,)
            still = [r for r in alive if r in holders]
            if len(still) < len(alive):
                for r in alive:
                    if r not in holders:
                        result[r] = depth
                alive = still
                if not alive:
                    break
            depth += 1
        for r in alive:
            result[r] = depth
        if touch:
            self._touch(hashes[: max(result.values())])
        return result

    def expire(self, now: float) -> int:
        """Drop predictions on event-fed replicas older than ``predicted_ttl_s``; return how many."""
        self.settle()
        self._clock(now)
        dropped = 0
        while self._pending and self._pending[0][0] + self.predicted_ttl_s < now:
            stamp, h, replica = self._pending.popleft()
            holders = self._entries.get(h)
            if holders.__class__ is dict and holders.get(replica, _CONFIRMED) == stamp:
                self._drop(h, holders, replica)
                dropped += 1
        self._expired += dropped
        return dropped

    def remove(self, hashes: Sequence[BlockHash], replica: ReplicaId) -> None:
        """Forget that ``replica`` holds ``hashes`` (a request it rejected, blocks it evicted)."""
        self.settle()
        for h in hashes:
            holders = self._entries.get(h)
            if holders is not None and _held_by(holders, replica):
                self._drop(h, holders, replica)

    def remove_replica(self, replica: ReplicaId) -> None:
        """Forget every block ``replica`` holds (it left the fleet or lost its cache)."""
        self.settle()
        if not self._per_replica.get(replica):
            return
        for h, holders in list(self._entries.items()):
            if holders.__class__ is str:
                if holders == replica:
                    del self._entries[h]
                continue
            holders.pop(replica, None)
            if not holders:
                del self._entries[h]
        del self._per_replica[replica]
        self._confirmed.pop(replica, None)

    def clear(self) -> None:
        """Forget everything (e.g. after a cache flush on every replica)."""
        self.settle()
        self._entries.clear()
        self._per_replica.clear()
        self._confirmed.clear()
        self._pending.clear()

    def stats(self) -> IndexStats:
        """Counters for metrics (O(replicas))."""
        self.settle()
        pairs, confirmed = sum(self._per_replica.values()), sum(self._confirmed.values())
        return IndexStats(len(self._entries), pairs - confirmed, confirmed, self._expired)

    def check_integrity(self) -> None:
        """Raise ``RuntimeError('bug: ...')`` if an invariant of the class is broken."""
        self.settle()
        if len(self._entries) > self.max_blocks:
            raise RuntimeError(f"bug: index holds {len(self._entries)} > {self.max_blocks}")
        counts: Counter[ReplicaId] = Counter()
        confirmed: Counter[ReplicaId] = Counter()
        for h, holders in self._entries.items():
            if not holders:
                raise RuntimeError(f"bug: empty replica set for block {h:#x}")
            if holders.__class__ is str:
                if holders in self._event_fed:
                    raise RuntimeError(f"bug: block {h:#x} holds event-fed {holders} without a stamp")
                counts[holders] += 1
                continue
            counts.update(holders.keys())
            confirmed.update(r for r, state in holders.items() if state is _CONFIRMED)
        if +counts != +self._per_replica or +confirmed != +self._confirmed:
            raise RuntimeError(
                f"bug: per-replica counts {dict(self._per_replica)} / {dict(self._confirmed)} "
                f"!= {dict(counts)} / {dict(confirmed)}"
            )

    def _clock(self, now: float | None) -> float:
        if now is not None and now > self._now:
            self._now = now
        return self._now if now is None else now

    def _holders(self, h: BlockHash) -> dict[ReplicaId, float | None]:
        holders = self._entries.pop(h, None)
        holders = self._entries[h] = {} if holders is None else _as_dict(holders)
        return holders

    def _drop(self, h: BlockHash, holders, replica: ReplicaId) -> None:
        if holders.__class__ is str:
            self._uncount(self._per_replica, replica)
            del self._entries[h]
            return
        if holders.pop(replica) is _CONFIRMED:
            self._uncount(self._confirmed, replica)
        self._uncount(self._per_replica, replica)
        if not holders:
            del self._entries[h]

    @staticmethod
    def _uncount(counter: Counter[ReplicaId], replica: ReplicaId) -> None:
        counter[replica] -= 1
        if counter[replica] == 0:
            del counter[replica]

    def _touch(self, hashes: Sequence[BlockHash]) -> None:
        entries = self._entries
        pop = entries.pop
        for h in reversed(hashes):
            entries[h] = pop(h)

    def _evict(self) -> None:
        entries = self._entries
        if len(entries) <= self.max_blocks:
            return
        oldest = list(itertools.islice(entries, len(entries) - self.max_blocks + self.evict_batch))
        evicted = list(map(entries.pop, oldest))
        singles = [v for v in evicted if v.__class__ is str]
        held = Counter(singles)  # counted in C: one pass per block otherwise
        if len(singles) < len(evicted):
            held.update(itertools.chain.from_iterable(v for v in evicted if v.__class__ is not str))
        confirmed: Counter[ReplicaId] = Counter()
        if self._confirmed:  # only replicas that publish KV events have confirmed blocks
            confirmed.update(r for holders in evicted if holders.__class__ is not str
                             for r, state in holders.items() if state is _CONFIRMED)
        for counter, gone in ((self._per_replica, held), (self._confirmed, confirmed)):
            for r, n in gone.items():
                counter[r] -= n
                if counter[r] == 0:
                    del counter[r]

    def _compact_pending(self) -> None:
        """Keep the expiry queue bounded: rebuild it from live predictions when it grows past
        twice the pairs the index can hold (stale items pile up when predictions repeat)."""
        if len(self._pending) <= 2 * self.max_blocks * max(1, len(self._event_fed)):
            return
        live = [(s, h, r) for h, holders in self._entries.items() if holders.__class__ is not str
                for r, s in holders.items() if s is not _CONFIRMED and r in self._event_fed]
        self._pending = deque(sorted(live, key=lambda item: item[0]))
