"""Engine requests placed on each replica lately: the balance term of a new key's placement.

A new key (a session's first turn, a GRPO group's first member, a prompt held nowhere) goes to
the replica with the least ``load + sent`` (``cache_policy.selection.least_loaded``): its
requests outstanding (in flight, queued in this router, waiting in vLLM) plus the engine
requests this router placed on it, each counted ``exp(-age / balance_window_s)`` (a fan-out
counts K). Outstanding load alone spread requests unevenly: pinned keys arrive in lumps (a
GRPO group is 16 requests, a scoring fan-out 8, a session 8 turns) and a replica whose sessions
wait for a slot looks idle, so new groups and fan-outs went wherever the lumps happened to have
left (``bench.sim`` 64 replicas, ws/kv 2, mixed, seeds 0-4: busiest replica 1.07-1.17x the mean
requests with load first and ``sent`` only breaking ties; see :class:`RecentlySent` for the
figures with the sum). A replica back in service, joining or back empty starts level with the
least-sent other (:meth:`RecentlySent.level`), so it does not draw a burst of new keys.

The decay keeps the term about the recent past: a replica back from an hour out of rotation is
not sent every new key until its lifetime total catches up. Values are stored scaled to a
common epoch (``raw = count * exp((t - epoch) / window)``), so one factor per decision,
``exp(-(now - epoch) / window)``, turns every stored value into its decayed count at ``now``;
the epoch moves forward (every value rescaled) once it is ``REBASE_WINDOWS`` windows old.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from cache_policy.types import ReplicaId

REBASE_WINDOWS = 30.0
"""Rescale stored values once the epoch is this many windows old (``exp(30)`` ~ 1e13: far from
float overflow, and rebasing is one pass over the replicas every 30 windows)."""


class RecentlySent:
    """Per replica, engine requests placed on it, decayed with time constant ``window_s``.

    Times are float seconds from the caller's clock; a clock that is not finite (a policy used
    without ``KeyRegistry.advance``) counts as the epoch: no decay.

    ``bench.sim`` 64 replicas, ws/kv 2, mixed, seeds 0-4 (``load + sent`` with a 300 s window
    against load first and lifetime ``sent`` only breaking ties): busiest/mean requests
    1.07-1.17 -> 1.06-1.08, makespan 164-174 -> 105-124 simulated s, agent turn p99 126-160 ->
    91-107 s, prefilled/ideal 1.026-1.034 -> 1.068-1.087 (sessions no longer gather where their
    prefixes keep each other). Windows of 60 s, 600 s and a lifetime total read 1.11-1.15,
    1.06-1.08 and 1.05 busiest/mean on seeds 0 and 3: the figure counts a run's lifetime, so
    the window trades it against how long old imbalance steers new keys.
    """

    def __init__(self, window_s: float) -> None:
        if not window_s > 0:
            raise ValueError(f"balance_window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._raw: dict[ReplicaId, float] = {}
        self._epoch: float | None = None
        """Time the stored values are scaled to: the first finite clock reading, then each rebase."""
        self._out: set[ReplicaId] = set()
        """Replicas out of service (unhealthy or out of rotation): their counts set no level."""

    def __contains__(self, rid: object) -> bool:
        return rid in self._raw

    def __iter__(self) -> Iterator[ReplicaId]:
        return iter(self._raw)

    def scale(self, now: float) -> float:
        """The factor that turns a stored value into its decayed count at ``now`` (<= 1)."""
        if self._epoch is None or not math.isfinite(now) or now <= self._epoch:
            return 1.0
        return math.exp(-(now - self._epoch) / self.window_s)

    @property
    def raw(self) -> dict[ReplicaId, float]:
        """Stored values (read-only): times :meth:`scale` they are the counts; for the scan."""
        return self._raw

    def get(self, rid: ReplicaId, now: float) -> float:
        """Decayed count of ``rid`` at ``now`` (0 for a replica never sent anything)."""
        return self._raw.get(rid, 0.0) * self.scale(now)

    def add(self, rid: ReplicaId, count: int, now: float) -> None:
        """``count`` engine requests were placed on ``rid`` at ``now``."""
        self._rebase(now)
        self._raw[rid] = self._raw.get(rid, 0.0) + count / self.scale(now)

    def undo(self, rid: ReplicaId, count: int, now: float) -> None:
        """``count`` requests placed on ``rid`` were not sent after all (refused, never dispatched):
        the decayed count at ``now`` drops by ``count``, never below 0 (placed a little earlier,
        they had decayed a little: at most ``count * (1 - exp(-wait / window))`` too much comes
        off: about a tenth of ``count`` for a 30 s wait in a 300 s window)."""
        if rid in self._raw:
            self._rebase(now)
            self._raw[rid] = max(0.0, self._raw[rid] - count / self.scale(now))

    def set(self, rid: ReplicaId, count: float, now: float) -> None:
        """Make ``rid``'s decayed count at ``now`` equal ``count`` (tests, and :meth:`level`)."""
        self._rebase(now)
        self._raw[rid] = count / self.scale(now)

    def level(self, rid: ReplicaId, *, keep_higher: bool = False) -> None:
        """``rid`` joins, is back empty or back in service: level with the least-sent other
        replica in service, not below it (at its own count it would be sent every new key until
        it caught up; a replica out of service was sent nothing either, so it sets no level).
        ``keep_higher``: a count already above that level stays."""
        own = self._raw.get(rid, 0.0)
        floor = min((v for r, v in self._raw.items() if r != rid and r not in self._out), default=None)
        if floor is None:
            self._raw[rid] = own if keep_higher else 0.0
        else:
            self._raw[rid] = max(floor, own) if keep_higher else floor

    def set_in_service(self, rid: ReplicaId, in_service: bool) -> None:
        """``rid`` went out of service, or came back (then it is levelled, its count kept if higher)."""
        if in_service:
            self._out.discard(rid)
            self.level(rid, keep_higher=True)
        else:
            self._out.add(rid)

    def drop(self, rid: ReplicaId) -> None:
        """Forget ``rid`` (it left)."""
        self._raw.pop(rid, None)
        self._out.discard(rid)

    def _rebase(self, now: float) -> None:
        if not math.isfinite(now):
            return
        if self._epoch is None:
            self._epoch = now
        elif now - self._epoch > REBASE_WINDOWS * self.window_s:
            factor = self.scale(now)
            self._raw = {rid: v * factor for rid, v in self._raw.items()}
            self._epoch = now
