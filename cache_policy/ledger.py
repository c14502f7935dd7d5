"""KvLedger: per replica, the KV blocks admitted requests hold (DESIGN rule 3).

What a replica holds, as the core projects it (blocks)::

    |<- max(scraped usage + unseen, committed) ->|<- parked ->|<- new ->|   <= watermark * blocks
     running requests: the replica's own metric,   live sessions   what this request adds
     or the router's in-flight peak, if larger     between turns

* committed: per in-flight request, the blocks it holds at its peak (prompt + max tokens;
  a started group's later members count only what they add beyond the shared prompt), so
  decode growth is reserved before it happens;
* unseen: of those, the requests admitted after the last scrape began (not in its usage);
* parked: the cached prefix of each live session between turns (``KeyRegistry.park``). vLLM
  counts those blocks as free (evictable), so its usage metric does not show them, but
  evicting them means prefilling the next turn again.

Pure bookkeeping: no I/O, times come from the caller's clock.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

import msgspec

from cache_policy.admission_queue import Priority
from cache_policy.sharing import PeerLoad
from cache_policy.types import ReplicaId


class Ticket(msgspec.Struct, frozen=True):
    """An admitted request's claim on its replica, given back when it finishes.

    ``blocks``: what it holds at its peak (prompt + max tokens; for a started group's member,
    beyond the shared prompt); ``new_blocks``: what admitting it added to the projection;
    ``requests``: how many engine requests it stands for (a scoring fan-out's K);
    ``group_id``: its GRPO group, if any.
    """

    replica_id: ReplicaId
    blocks: int
    new_blocks: int
    session_id: str | None
    admitted_at: float
    priority: Priority
    number: int
    requests: int = 1
    group_id: str | None = None


_NEVER = float("-inf")
"""The scrape time of a replica never scraped: every ticket on it is unseen."""

NO_PEER = PeerLoad()
"""The share of a replica no other router reports (zero requests and blocks)."""


class KvLedger:
    """Per replica: tickets in flight (committed blocks).

    Invariant: ``_in_flight[r]`` holds exactly the tickets admitted to ``r`` and not yet
    released; ``_requests[r]`` is the sum of their ``requests``, ``_blocks[r]`` of their ``blocks``.
    """

    def __init__(self) -> None:
        self._in_flight: dict[ReplicaId, dict[int, Ticket]] = {}
        self._requests: dict[ReplicaId, int] = {}
        self._blocks: dict[ReplicaId, int] = {}
        """:meth:`committed`, kept as tickets come and go (admission projects every waiting
        replica on every pump: a sum over its tickets each time was O(tickets))."""
        self._groups: Counter[tuple[str, ReplicaId]] = Counter()
        """Tickets in flight per ``(group_id, replica)``."""
        self.scraped_at: dict[ReplicaId, float] = {}
        """When each replica's last scrape began (set by :meth:`scraped`)."""
        self._unseen: dict[ReplicaId, int] = {}
        """:meth:`unseen`, kept as tickets come and go and recounted when a scrape begins."""
        self.peers: dict[ReplicaId, PeerLoad] = {}
        """Other routers' shares per replica (``cache_policy.sharing``; empty with one router)."""
        self.changed: set[ReplicaId] = set()
        """Replicas whose request count changed since the core last rebuilt their views
        (``DecisionCore._views_of``); the core empties it."""
        self._gone: set[ReplicaId] = set()
        """Replicas that left with tickets still out: their entries go with the last one."""

    def sizes(self) -> dict[str, int]:
        """Entries held: ``tickets`` (requests admitted and not released) and ``running_groups``
        (GRPO groups with a ticket, per replica)."""
        return {"tickets": sum(map(len, self._in_flight.values())), "running_groups": len(self._groups)}

    def admit(self, ticket: Ticket) -> None:
        """Count ``ticket`` against its replica."""
        self._gone.discard(ticket.replica_id)  # (a replica that left and came back under its name)
        self._in_flight.setdefault(ticket.replica_id, {})[ticket.number] = ticket
        self._requests[ticket.replica_id] = self._requests.get(ticket.replica_id, 0) + ticket.requests
        self.changed.add(ticket.replica_id)
        self._blocks[ticket.replica_id] = self._blocks.get(ticket.replica_id, 0) + ticket.blocks
        if ticket.admitted_at > self.scraped_at.get(ticket.replica_id, _NEVER):
            self._unseen[ticket.replica_id] = self._unseen.get(ticket.replica_id, 0) + ticket.blocks
        if ticket.group_id is not None:
            self._groups[(ticket.group_id, ticket.replica_id)] += 1

    def release(self, ticket: Ticket) -> None:
        """Stop counting ``ticket``; RuntimeError (bug) if it was not admitted or is released twice."""
        held = self._in_flight.get(ticket.replica_id, {})
        if held.pop(ticket.number, None) is None:
            raise RuntimeError(f"bug: ticket {ticket.number} released twice or never admitted")
        self._requests[ticket.replica_id] -= ticket.requests
        self.changed.add(ticket.replica_id)
        self._blocks[ticket.replica_id] -= ticket.blocks
        if ticket.admitted_at > self.scraped_at.get(ticket.replica_id, _NEVER):
            self._unseen[ticket.replica_id] -= ticket.blocks
        if ticket.group_id is not None:
            key = (ticket.group_id, ticket.replica_id)
            self._groups[key] -= 1
            if not self._groups[key]:
                del self._groups[key]
        if ticket.replica_id in self._gone and not held:
            self._drop(ticket.replica_id)

    def group_running(self, group_id: str | None, rid: ReplicaId) -> bool:
        """Whether a request of GRPO group ``group_id`` is in flight on ``rid``."""
        return group_id is not None and (group_id, rid) in self._groups

    @property
    def requests_by_replica(self) -> Mapping[ReplicaId, int]:
        """Engine requests in flight per replica (:meth:`count` for all at once; read-only)."""
        return self._requests

    def count(self, rid: ReplicaId) -> int:
        """Engine requests in flight on ``rid`` (a fan-out counts each of its requests)."""
        return self._requests.get(rid, 0)

    def tickets(self, rid: ReplicaId) -> Iterable[Ticket]:
        """The tickets in flight on ``rid`` (read-only)."""
        return self._in_flight.get(rid, {}).values()

    def committed(self, rid: ReplicaId) -> int:
        """Blocks the tickets on ``rid`` hold at their peak."""
        return self._blocks.get(rid, 0)

    def is_unseen(self, ticket: Ticket) -> bool:
        """Whether ``ticket`` was admitted after its replica's last scrape began (counted in :meth:`unseen`)."""
        return ticket.admitted_at > self.scraped_at.get(ticket.replica_id, _NEVER)

    def unseen(self, rid: ReplicaId) -> int:
        """Blocks of tickets admitted to ``rid`` after its last scrape began."""
        return self._unseen.get(rid, 0)

    def scraped(self, rid: ReplicaId, started_at: float | None) -> None:
        """``rid``'s last scrape began at ``started_at`` (None: never): tickets admitted since are
        unseen in its usage."""
        if started_at is None:
            self.scraped_at.pop(rid, None)
        else:
            self.scraped_at[rid] = started_at
        self._unseen[rid] = self._unseen_of(rid)

    def _unseen_of(self, rid: ReplicaId) -> int:
        since = self.scraped_at.get(rid, _NEVER)
        return sum(t.blocks for t in self._in_flight.get(rid, {}).values() if t.admitted_at > since)

    def peer(self, rid: ReplicaId) -> PeerLoad:
        """Other routers' share on ``rid`` (zero when none)."""
        return self.peers.get(rid, NO_PEER)

    def forget_replica(self, rid: ReplicaId) -> None:
        """``rid`` left: its tickets are released by their requests; its entries (counts, scrape
        time, peers' share) go now, or with its last ticket (a fleet changing for days must not
        keep an entry per replica it ever had)."""
        self.peers.pop(rid, None)
        self.changed.add(rid)
        if self._in_flight.get(rid):
            self.scraped(rid, None)
            self._gone.add(rid)
        else:
            self._drop(rid)

    def _drop(self, rid: ReplicaId) -> None:
        self._gone.discard(rid)
        for entries in (self._in_flight, self._requests, self._blocks, self._unseen, self.scraped_at):
            entries.pop(rid, None)

    def check_integrity(self) -> None:
        """Raise ``RuntimeError('bug: ...')`` if the request counts disagree with the tickets."""
        for rid, held in self._in_flight.items():
            if sum(t.requests for t in held.values()) != self._requests.get(rid, 0):
                raise RuntimeError(f"bug: request count of {rid} disagrees with its tickets")
            if sum(t.blocks for t in held.values()) != self._blocks.get(rid, 0):
                raise RuntimeError(f"bug: committed blocks of {rid} disagree with its tickets")
            if self._unseen_of(rid) != self._unseen.get(rid, 0):
                raise RuntimeError(f"bug: unseen blocks of {rid} disagree with its tickets")
        groups = Counter((t.group_id, t.replica_id) for held in self._in_flight.values()
                         for t in held.values() if t.group_id is not None)
        if groups != +self._groups:
            raise RuntimeError(f"bug: group counts {dict(self._groups)} disagree with the tickets")
