"""AdmissionQueueStore: the storage and service order behind ``AdmissionQueue``.

Layout (service order left to right)::

    continuing sessions, round-robin over ids      group members   new requests
    {s1: [a, b], s2: [c], s3: [d]} -> a c d b      [g1, g2, ...]   [n1, n2, ...]

A session moves to the back of the rotation when one of its requests is served; a new
session joins at the back. Requests are held by identity (two equal frozen requests are
still two requests).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable
from itertools import chain, zip_longest
from typing import Literal, get_args

import msgspec

from cache_policy.types import ReplicaId

Priority = Literal["continuing_session", "group_member", "new"]
PRIORITIES: tuple[Priority, ...] = get_args(Priority)
"""Priority classes, highest first."""

_RANK = {p: i for i, p in enumerate(PRIORITIES)}


class AdmissionRequest(msgspec.Struct, frozen=True):
    """One routed request asking for room on ``replica_id``.

    ``new_blocks``: KV blocks it will add beyond its expected prefix hit
    (see ``cache_policy.admission.blocks_needed``). ``enqueued_at``: arrival time, seconds.
    ``request_id``: the caller's handle, opaque here.
    """

    replica_id: ReplicaId
    new_blocks: int = 0
    priority: Priority = "new"
    session_id: str | None = None
    enqueued_at: float = 0.0
    request_id: str = ""
    holds: int = 0
    """Blocks its ticket will hold once admitted (its peak, less a started group's shared prompt)."""
    requests: int = 1
    """Engine requests it stands for (a scoring fan-out's K)."""
    group_id: str | None = None
    """Its GRPO group, if any (a member whose group's first request still waits joins it)."""
    joined_holds: int | None = None
    """A GRPO member's ``holds`` when admitted with its group running on the replica: the
    group's prompt is held by the running member, so only the blocks beyond it count (None:
    not a group member). Placed while the group's first request waited, a member found none of
    the prompt cached and counted all of it: 16 members reserved the prompt 16 times
    (``bench.sim``: committed blocks 1.1-1.8x the cache while the engine used a third)."""
    joined_new_blocks: int | None = None
    """``new_blocks`` likewise (see :attr:`joined_holds`)."""

    @property
    def opens_session(self) -> bool:
        """The first request of a session (or one whose session went idle): it adds a session."""
        return self.session_id is not None and self.priority != "continuing_session"

    def joined(self) -> AdmissionRequest:
        """This request as admitted with its running group (:attr:`joined_holds`)."""
        if self.joined_holds is None or self.joined_new_blocks is None:
            return self
        return msgspec.structs.replace(self, holds=self.joined_holds, new_blocks=self.joined_new_blocks)

    def __post_init__(self) -> None:
        if self.new_blocks < 0:
            raise ValueError(f"new_blocks must be >= 0, got {self.new_blocks}")
        if self.priority not in PRIORITIES:
            raise ValueError(f"priority must be one of {PRIORITIES}, got {self.priority!r}")
        if self.priority == "continuing_session" and self.session_id is None:
            raise ValueError("priority 'continuing_session' needs a session_id")


class AdmissionQueueStore:
    """Queued ``AdmissionRequest``s by priority class; no capacity logic (the queue has it).

    Invariants: no session list is empty; every request in ``_sessions[s]`` is a
    continuing-session request of session ``s``; ``_group`` holds only group members and
    ``_new`` only new requests, each in arrival order; ``_requests[r]`` is the sum of
    ``requests`` over the queued requests for replica ``r`` that do not open a session (kept
    incrementally: placement reads it on every decision as load); ``_groups[g]`` counts the
    queued requests of group ``g``; ``_classes[(r, k)]`` the queued requests for replica ``r`` of
    priority rank ``k``.

    A session's first request waiting for room among the replica's sessions
    (``AdmissionState.sessions_full``) is not load there: counted, the replicas with waiting
    sessions looked busy and short-lived work piled onto the others (64 replicas, ws/kv 2 in
    ``bench.sim``: busiest/mean requests 1.39, prefilled/ideal 1.68; not counted: 1.17, 1.31).
    """

    def __init__(self) -> None:
        self._sessions: OrderedDict[str, list[AdmissionRequest]] = OrderedDict()
        self._group: list[AdmissionRequest] = []
        self._new: list[AdmissionRequest] = []
        self._requests: Counter[str] = Counter()
        self._groups: Counter[str] = Counter()
        self._classes: Counter[tuple[str, int]] = Counter()
        """Queued requests per (replica, priority rank): :meth:`has_waiting` on every admission."""
        self._oldest: float | None = None
        """The earliest ``enqueued_at`` queued (:meth:`oldest_enqueued_at`), unless ``_oldest_stale``."""
        self._oldest_stale = False
        self.changed: set[str] = set()
        """Replicas whose queued count changed since the core last rebuilt their views
        (``DecisionCore._views_of``); the core empties it."""

    @property
    def requests_by_replica(self) -> Counter[str]:
        """Engine requests queued per replica, session openers aside (a fan-out counts K;
        read-only)."""
        return self._requests

    def __len__(self) -> int:
        return sum(map(len, self._sessions.values())) + len(self._group) + len(self._new)

    def push(self, req: AdmissionRequest) -> None:
        """Queue ``req`` at the back of its class (its session's list for sessions)."""
        if not req.opens_session:
            self._requests[req.replica_id] += req.requests
            self.changed.add(req.replica_id)
        if req.group_id is not None:
            self._groups[req.group_id] += 1
        self._classes[req.replica_id, _RANK[req.priority]] += 1
        if not self._oldest_stale and (self._oldest is None or req.enqueued_at < self._oldest):
            self._oldest = req.enqueued_at
        if req.priority == "continuing_session":
            assert req.session_id is not None, "bug: continuing request without session"
            self._sessions.setdefault(req.session_id, []).append(req)
        elif req.priority == "group_member":
            self._group.append(req)
        else:
            self._new.append(req)

    def in_order(self) -> list[AdmissionRequest]:
        """All queued requests in service order."""
        rounds = zip_longest(*self._sessions.values())
        continuing = [r for r in chain.from_iterable(rounds) if r is not None]
        return continuing + self._group + self._new

    def remove(self, reqs: Iterable[AdmissionRequest], *, served: bool = False) -> None:
        """Remove ``reqs`` (by identity); ``served`` rotates their sessions to the back."""
        gone = {id(r): r for r in reqs}
        if not gone:
            return
        present = [r for r in self._all() if id(r) in gone]
        for r in present:
            if not r.opens_session:
                self.changed.add(r.replica_id)
                self._requests[r.replica_id] -= r.requests
                if not self._requests[r.replica_id]:
                    del self._requests[r.replica_id]
            if r.group_id is not None:
                self._groups[r.group_id] -= 1
                if not self._groups[r.group_id]:
                    del self._groups[r.group_id]
            cls = (r.replica_id, _RANK[r.priority])
            self._classes[cls] -= 1
            if not self._classes[cls]:
                del self._classes[cls]
            if self._oldest is not None and r.enqueued_at <= self._oldest:
                self._oldest_stale = True  # the oldest may have left: found again when next asked
        touched = [s for s, q in self._sessions.items() if any(id(r) in gone for r in q)]
        for sid in touched:
            rest = [r for r in self._sessions[sid] if id(r) not in gone]
            if rest:
                self._sessions[sid] = rest
                if served:
                    self._sessions.move_to_end(sid)
            else:
                del self._sessions[sid]
        self._group = [r for r in self._group if id(r) not in gone]
        self._new = [r for r in self._new if id(r) not in gone]

    def has_waiting(self, replica_id: str, priority: Priority) -> bool:
        """Whether a request of equal or higher priority waits for ``replica_id``."""
        classes = self._classes
        return bool(classes) and any((replica_id, r) in classes for r in range(_RANK[priority] + 1))

    def has_group(self, group_id: str | None) -> bool:
        """Whether a request of GRPO group ``group_id`` waits (False for ``None``)."""
        return group_id is not None and group_id in self._groups

    def _all(self) -> Iterable[AdmissionRequest]:
        """Every queued request, in no particular order (cheaper than :meth:`in_order`)."""
        return chain(chain.from_iterable(self._sessions.values()), self._group, self._new)

    def displaceable(self, priority: Priority) -> AdmissionRequest | None:
        """The newest request of the lowest class strictly below ``priority``, if any."""
        rank = _RANK[priority]
        for cls_rank, queue in ((2, self._new), (1, self._group)):
            if cls_rank > rank and queue:
                return queue[-1]
        return None

    def oldest_enqueued_at(self) -> float | None:
        """Earliest ``enqueued_at`` among queued requests, or ``None`` when empty (kept as requests
        come; looked for again only after the oldest left: the queue's expiry asks on every
        admission and pump)."""
        if self._oldest_stale:
            self._oldest = min((r.enqueued_at for r in self._all()), default=None)
            self._oldest_stale = False
        return self._oldest

    def check_integrity(self) -> None:
        """Raise ``RuntimeError('bug: ...')`` if an invariant of the class is broken."""
        for sid, q in self._sessions.items():
            if not q or any(r.session_id != sid or r.priority != "continuing_session" for r in q):
                raise RuntimeError(f"bug: malformed session queue {sid!r}")
        if any(r.priority != "group_member" for r in self._group):
            raise RuntimeError("bug: non-group request in the group queue")
        if any(r.priority != "new" for r in self._new):
            raise RuntimeError("bug: non-new request in the new queue")
        counts: Counter[str] = Counter()
        for r in self.in_order():
            if not r.opens_session:
                counts[r.replica_id] += r.requests
        if Counter(r.group_id for r in self.in_order() if r.group_id is not None) != +self._groups:
            raise RuntimeError(f"bug: queued groups {dict(self._groups)} disagree with the queue")
        if Counter((r.replica_id, _RANK[r.priority]) for r in self.in_order()) != +self._classes:
            raise RuntimeError(f"bug: queued requests per replica and class {dict(self._classes)} disagree with the queue")
        if self.oldest_enqueued_at() != min((r.enqueued_at for r in self._all()), default=None):
            raise RuntimeError(f"bug: the oldest queued request is not at {self._oldest}")
        if +counts != +self._requests:
            raise RuntimeError(f"bug: queued requests per replica {dict(self._requests)} != {dict(counts)}")
