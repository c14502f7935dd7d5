"""The router's KV ledger: per replica, what admitted requests hold and what live sessions park.

See ``router.admission`` for how the projection is built from it. Pure bookkeeping: no I/O,
times come from the caller's clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from cache_policy.admission import Priority
from cache_policy.types import ReplicaId


@dataclass(frozen=True)
class Ticket:
    """An admitted request's claim on its replica, returned to :meth:`AdmissionController.release`.

    ``blocks``: what it holds at its peak (prompt + max tokens; for a started group's member,
    beyond the shared prompt); ``new_blocks``: what admitting it added to the projection.
    """

    replica_id: ReplicaId
    blocks: int
    new_blocks: int
    session_id: str | None
    admitted_at: float
    priority: Priority
    number: int


class KvLedger:
    """Per replica: tickets in flight (committed blocks) and parked sessions' prefixes.

    Invariant: ``_in_flight[r]`` holds exactly the tickets admitted to ``r`` and not yet
    released; ``_parked`` maps a session to ``(replica, blocks)`` only while none of its
    requests is in flight.
    """

    def __init__(self) -> None:
        self._in_flight: dict[ReplicaId, dict[int, Ticket]] = {}
        self._parked: dict[str, tuple[ReplicaId, int]] = {}
        self.scraped_at = float("-inf")

    def admit(self, ticket: Ticket) -> None:
        self._in_flight.setdefault(ticket.replica_id, {})[ticket.number] = ticket
        if ticket.session_id is not None:
            self._parked.pop(ticket.session_id, None)

    def release(self, ticket: Ticket) -> None:
        held = self._in_flight.get(ticket.replica_id, {})
        if held.pop(ticket.number, None) is None:
            raise RuntimeError(f"bug: ticket {ticket.number} released twice or never admitted")
        if ticket.session_id is not None:
            self._parked[ticket.session_id] = (ticket.replica_id, ticket.blocks)

    def parked_of(self, session_id: str | None, rid: ReplicaId) -> int:
        """Blocks ``session_id`` has parked on ``rid`` (0 elsewhere or when none)."""
        entry = self._parked.get(session_id) if session_id is not None else None
        return entry[1] if entry is not None and entry[0] == rid else 0

    def keep_live(self, live: set[str]) -> None:
        """Forget parked prefixes of sessions that are no longer live."""
        for sid in [s for s in self._parked if s not in live]:
            del self._parked[sid]

    def count(self, rid: ReplicaId) -> int:
        return len(self._in_flight.get(rid, {}))

    def committed(self, rid: ReplicaId) -> int:
        return sum(t.blocks for t in self._in_flight.get(rid, {}).values())

    def unseen(self, rid: ReplicaId) -> int:
        return sum(t.blocks for t in self._in_flight.get(rid, {}).values() if t.admitted_at > self.scraped_at)

    def parked(self, rid: ReplicaId) -> int:
        return sum(blocks for r, blocks in self._parked.values() if r == rid)

    def check_integrity(self) -> None:
        """Raise ``RuntimeError('bug: ...')`` if a parked session also has a request in flight."""
        busy = {t.session_id for held in self._in_flight.values() for t in held.values()}
        if busy & set(self._parked):
            raise RuntimeError(f"bug: sessions both parked and in flight: {sorted(busy & set(self._parked))}")
