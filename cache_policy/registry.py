"""KeyRegistry: every session and GRPO group the router knows, in one bounded table.

One record per ``(kind, key)`` holds everything a decision needs about that key::

    pin            replica the key is pinned to (session affinity, GRPO group affinity)
    own_in_flight  requests of the key running on the pin's replica (a scoring fan-out counts K)
    in_flight      requests of the key running anywhere (a live key never expires)
    last_seen      last admission or finish: a session seen within ``session_idle_s`` is
                   *continuing* for admission (DESIGN rule 3); a group seen so is *started*
    start_version  weight version the key started under (keep+salt keeps its salt, seed 003)
    parked         sessions only: ``(replica, blocks)`` of its prefix between turns

Bounds: at most ``PolicyConfig.max_pins`` records, least recently used first out (never one
with requests in flight while another can go), and a record untouched for longer than
``PolicyConfig.key_ttl_s`` with nothing in flight expires (:meth:`expire`). Times are float
seconds from the caller's clock; :meth:`advance` records the latest one for the pin-table
methods the policies call without a clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from cache_policy.types import ReplicaId

KeyKind = Literal["session", "group"]
PinKind = KeyKind


@dataclass
class KeyRecord:
    """One session's or group's state; see the module docstring for each field."""

    replica: ReplicaId | None = None
    own_in_flight: int = 0
    in_flight: int = 0
    last_seen: float = float("-inf")
    touched: float = float("-inf")
    start_version: int | None = None
    parked: tuple[ReplicaId, int] | None = None
    parked_stamp: int | None = None
    """The replica's free-queue counter just before the prefix was released
    (``FreeQueueModel.freed``): ``freed - parked_stamp``, less the blocks released after it that
    hits took out of the queue since, bounds the rank of its deepest block from the tail."""
    ended: bool = False
    """The client ended the key while requests of it were in flight (:meth:`KeyRegistry.end`):
    their finish parks nothing, and the last one drops the record (:meth:`KeyRegistry.drop_ended`).
    Placing one of them again (a retry, a replica gone) does not revive it; a request opened after
    the end does (:meth:`KeyRegistry.reopen`)."""
    end_sampled: bool = False
    """The size the session ended at was taken (``AdmissionState.session_blocks``): by the end
    itself (its parked prefix) or by the release of a turn that ran through it; once per ending."""

    def __post_init__(self) -> None:
        assert self.own_in_flight >= 0 and self.in_flight >= 0, "bug: negative in-flight count"


class KeyRegistry:
    """``(kind, key) -> KeyRecord``, LRU ordered, with the pin-table interface the policies use.

    Invariants: ``own_in_flight <= in_flight`` for every record; ``_parked_sum[r]`` is the
    sum of parked blocks on ``r``, and ``_parked_order[r]`` holds exactly the records parked on
    ``r``, oldest parked first. A parked prefix is unparked when the session's next request
    is admitted (``started_session``), and parked again when the last one in flight ends.
    """

    def __init__(self, max_keys: int, ttl_s: float) -> None:
        if max_keys < 1:
            raise ValueError(f"max_pins must be >= 1, got {max_keys}")
        self.max_keys = max_keys
        self.ttl_s = ttl_s
        self.max_pins = max_keys
        self._records: OrderedDict[tuple[KeyKind, str], KeyRecord] = OrderedDict()
        self._parked_sum: dict[ReplicaId, int] = {}
        self._parked_order: dict[ReplicaId, OrderedDict[int, KeyRecord]] = {}
        """Per replica, its parked records (by ``id``) oldest parked first."""
        self._now = float("-inf")

    def __len__(self) -> int:
        return sum(1 for r in self._records.values() if r.replica is not None)

    def sizes(self) -> dict[str, int]:
        """Entries held: ``keys`` (session and group records, at most ``max_pins``) and ``parked``
        (sessions' prefixes parked between turns)."""
        return {"keys": len(self._records), "parked": sum(map(len, self._parked_order.values()))}

    def advance(self, now: float) -> None:
        """The caller's clock moved to ``now`` (used by the clock-less pin methods)."""
        self._now = max(self._now, now)

    @property
    def now(self) -> float:
        """The latest time :meth:`advance` was given (``-inf`` before the first)."""
        return self._now

    def record_of(self, kind: KeyKind, key: str) -> KeyRecord | None:
        """The record of ``key`` (not touched), or ``None``."""
        return self._records.get((kind, key))

    def touch(self, kind: KeyKind, key: str) -> KeyRecord:
        """The record of ``key``, created if new, moved to the most recently used end."""
        rec = self._records.get((kind, key))
        if rec is None:
            rec = self._records[(kind, key)] = KeyRecord()
            self._evict(keep=(kind, key))  # never the record asked for (when every other is in flight)
        self._records.move_to_end((kind, key))
        rec.touched = self._now
        return rec

    # -- the pin table (cache_policy.affinity) -------------------------------------------------

    def get(self, kind: KeyKind, key: str) -> KeyRecord | None:
        """The pin of ``key`` (a record with a replica), or ``None``; refreshes its LRU place."""
        rec = self._records.get((kind, key))
        if rec is None or rec.replica is None:
            return None
        self._records.move_to_end((kind, key))
        return rec

    def record(self, kind: KeyKind, key: str, replica: ReplicaId) -> None:
        """Pin ``key`` to ``replica``; a move resets ``own_in_flight``."""
        rec = self.touch(kind, key)
        if rec.replica != replica:
            rec.replica, rec.own_in_flight = replica, 0

    def started(self, kind: KeyKind, key: str, replica: ReplicaId, count: int = 1) -> None:
        """``count`` more requests of ``key`` run on ``replica`` (a key its client ended stays ended:
        only a request opened after the end revives it, :meth:`reopen`)."""
        rec = self.touch(kind, key)
        rec.in_flight += count
        if rec.replica == replica:
            rec.own_in_flight += count

    def reopen(self, kind: KeyKind, key: str) -> None:
        """A new request of ``key`` arrived: a key its client ended lives again (the client reused
        the id), with nothing of its old pin or size kept. Requests opened before the end keep
        it ended, however often they are placed again (:attr:`KeyRecord.ended`)."""
        rec = self._records.get((kind, key))
        if rec is not None and rec.ended:
            rec.ended = rec.end_sampled = False

    def finished(self, kind: KeyKind, key: str, replica: ReplicaId, count: int = 1) -> None:
        """``count`` requests of ``key`` ended on ``replica``; never counts below zero."""
        rec = self._records.get((kind, key))
        if rec is None:
            return
        rec.in_flight = max(0, rec.in_flight - count)
        if rec.replica == replica:
            rec.own_in_flight = max(0, rec.own_in_flight - count)
        rec.own_in_flight = min(rec.own_in_flight, rec.in_flight)
        if not rec.in_flight and len(self._records) > self.max_keys:  # over the bound while all were in flight
            self._evict()

    def unpin(self, kind: KeyKind, key: str, replica: ReplicaId) -> None:
        """Undo the pin of ``key`` to ``replica`` (a refused first request), if it is that one."""
        rec = self._records.get((kind, key))
        if rec is not None and rec.replica == replica:
            rec.replica, rec.own_in_flight = None, 0

    def pins(self) -> list[tuple[KeyKind, str, ReplicaId, int | None]]:
        """Every pinned key: ``(kind, key, replica, start_version)``."""
        return [(kind, key, r.replica, r.start_version) for (kind, key), r in self._records.items()
                if r.replica is not None]

    def replicas(self) -> set[ReplicaId]:
        """Replicas that hold at least one pin."""
        return {r.replica for r in self._records.values() if r.replica is not None}

    def drop_replica(self, replica: ReplicaId) -> None:
        """Forget every pin and parked prefix on ``replica`` (it left or lost its cache)."""
        for rec in self._records.values():
            if rec.replica == replica:
                rec.replica, rec.own_in_flight = None, 0
            if rec.parked is not None and rec.parked[0] == replica:
                self._unpark(rec)

    # -- liveness, parked prefixes, expiry -------------------------------------------------------

    def seen(self, kind: KeyKind, key: str, now: float, *, create: bool = True) -> None:
        """``key`` was admitted or finished a request at ``now``. ``create`` False: only if it still
        has a record (a finished request's key evicted over ``max_keys`` is not made again)."""
        if not create and (kind, key) not in self._records:
            return
        rec = self.touch(kind, key)
        rec.last_seen = max(rec.last_seen, now)

    def is_live(self, kind: KeyKind, key: str | None, now: float, idle_s: float) -> bool:
        """Seen within ``idle_s`` of ``now``."""
        rec = self._records.get((kind, key)) if key is not None else None
        return rec is not None and now - rec.last_seen <= idle_s

    def park(self, session_id: str, replica: ReplicaId, blocks: int, limit: int | None = None,
             stamp: int | None = None, *, create: bool = True) -> None:
        """Session ``session_id`` holds ``blocks`` of prefix on ``replica`` between turns.

        With ``limit``, parked prefixes on ``replica`` count at most ``limit`` blocks: the oldest
        parked first stop counting (this one too, if it alone is larger). See
        ``cache_policy.admission_state.parked_limit`` for why. ``create`` False: only if the session
        still has a record (see :meth:`seen`)."""
        if not create and ("session", session_id) not in self._records:
            return
        rec = self.touch("session", session_id)
        self._unpark(rec)
        if rec.in_flight == 0 and not rec.ended:
            rec.parked, rec.parked_stamp = (replica, blocks), stamp
            self._parked_sum[replica] = self._parked_sum.get(replica, 0) + blocks
            self._parked_order.setdefault(replica, OrderedDict())[id(rec)] = rec
            while limit is not None and self._parked_sum.get(replica, 0) > limit:
                self._unpark(next(iter(self._parked_order[replica].values())))

    def started_session(self, session_id: str) -> None:
        """A request of ``session_id`` was admitted: its prefix is in use, no longer parked."""
        rec = self._records.get(("session", session_id))
        if rec is not None:
            self._unpark(rec)

    def parked_of(self, session_id: str | None, replica: ReplicaId) -> int:
        """Blocks ``session_id`` has parked on ``replica`` (0 elsewhere or when none)."""
        rec = self._records.get(("session", session_id)) if session_id is not None else None
        return rec.parked[1] if rec is not None and rec.parked and rec.parked[0] == replica else 0

    def parked_on(self, replica: ReplicaId) -> Iterable[KeyRecord]:
        """Records of the sessions parked on ``replica``, oldest parked first (read-only; do not
        park or unpark while iterating)."""
        return self._parked_order.get(replica, {}).values()

    def drop_parked(self, rec: KeyRecord) -> None:
        """Stop counting ``rec``'s parked prefix (the engine will have evicted it)."""
        self._unpark(rec)

    def parked_blocks(self, replica: ReplicaId) -> int:
        """Blocks all parked sessions hold on ``replica``."""
        return self._parked_sum.get(replica, 0)

    def unpark_idle(self, now: float, idle_s: float, keep: set[str]) -> list[int]:
        """Stop counting parked prefixes of sessions unseen for ``idle_s`` (except ``keep``);
        returns their sizes in blocks (sessions that ended without saying so)."""
        sizes = []
        for (kind, key), rec in self._records.items():
            if rec.parked is not None and key not in keep and now - rec.last_seen > idle_s:
                sizes.append(rec.parked[1])
                self._unpark(rec)
        return sizes

    def end(self, kind: KeyKind, key: str) -> bool:
        """The client ended ``key``: drop its pin, parked prefix and start version (the record
        too once nothing of it is in flight: :meth:`drop_ended`). False when there is nothing
        to end (never seen, already ended, or expired)."""
        rec = self._records.get((kind, key))
        if rec is None or rec.ended:
            return False
        self._unpark(rec)
        rec.replica, rec.own_in_flight, rec.start_version, rec.ended = None, 0, None, True
        self.drop_ended(kind, key)
        return True

    def drop_ended(self, kind: KeyKind, key: str) -> None:
        """Forget ``key`` if it was ended and nothing of it is in flight any more."""
        rec = self._records.get((kind, key))
        if rec is not None and rec.ended and rec.in_flight == 0:
            self._unpark(rec)
            del self._records[(kind, key)]

    def expire(self, now: float) -> int:
        """Drop records untouched for longer than ``ttl_s`` with nothing in flight; how many."""
        stale = [k for k, r in self._records.items() if r.in_flight == 0 and now - r.touched > self.ttl_s]
        for k in stale:
            self._unpark(self._records.pop(k))
        return len(stale)

    def check_integrity(self) -> None:
        """Raise ``RuntimeError('bug: ...')`` if a bound or an invariant is broken."""
        idle = sum(1 for r in self._records.values() if r.in_flight == 0)
        if len(self._records) > self.max_keys and idle > 1:  # one new key is kept while all others run (touch)
            raise RuntimeError(f"bug: {len(self._records)} key records > max_pins {self.max_keys} with {idle} idle")
        sums: dict[ReplicaId, int] = {}
        for (kind, key), r in self._records.items():
            if r.own_in_flight > r.in_flight:
                raise RuntimeError(f"bug: {kind} {key!r} own_in_flight {r.own_in_flight} > {r.in_flight}")
            if r.parked is not None:
                sums[r.parked[0]] = sums.get(r.parked[0], 0) + r.parked[1]
        sums = {k: v for k, v in sums.items() if v}  # a 0-block prefix may be parked
        if {k: v for k, v in self._parked_sum.items() if v} != sums:
            raise RuntimeError(f"bug: parked sums {self._parked_sum} != records {sums}")
        order = {rid: sum(r.parked[1] for r in recs.values() if r.parked and r.parked[0] == rid)
                 for rid, recs in self._parked_order.items()}
        if {k: v for k, v in order.items() if v} != sums:
            raise RuntimeError(f"bug: parked order {order} != records {sums}")

    def _unpark(self, rec: KeyRecord) -> None:
        if rec.parked is not None:
            rid, blocks = rec.parked
            left = self._parked_sum.get(rid, 0) - blocks  # a 0-block prefix may be parked
            if left:
                self._parked_sum[rid] = left
            else:
                self._parked_sum.pop(rid, None)
            order = self._parked_order.get(rid, {})
            order.pop(id(rec), None)
            if not order:
                self._parked_order.pop(rid, None)
            rec.parked = None

    def _evict(self, keep: tuple[KeyKind, str] | None = None) -> None:
        """Past ``max_keys``, drop least recently used records, idle ones first (never ``keep``)."""
        while len(self._records) > self.max_keys:
            victim = next((k for k, r in self._records.items() if r.in_flight == 0 and k != keep), None)
            if victim is None:
                return  # everything is in flight: over the bound until some finish
            self._unpark(self._records.pop(victim))
