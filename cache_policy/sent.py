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
        self._epoch = 0.0

    def __contains__(self, rid: object) -> bool:
        return rid in self._raw

    def __iter__(self) -> Iterator[ReplicaId]:
        return iter(self._raw)

    def scale(self, now: float) -> float:
        """The factor that turns a stored value into its decayed count at ``now`` (<= 1)."""
        if not math.isfinite(now) or now <= self._epoch:
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

    def set(self, rid: ReplicaId, count: float, now: float) -> None:
        """Make ``rid``'s decayed count at ``now`` equal ``count`` (tests, and :meth:`level`)."""
        self._rebase(now)
        self._raw[rid] = count / self.scale(now)

    def level(self, rid: ReplicaId, *, keep_higher: bool = False) -> None:
        """``rid`` joins, is back empty or back in service: level with the least-sent other
        replica, not below it (at its own count it would be sent every new key until it caught
        up). ``keep_higher``: a count already above that level stays."""
        floor = min((v for r, v in self._raw.items() if r != rid), default=0.0)
        self._raw[rid] = max(floor, self._raw.get(rid, 0.0)) if keep_higher else floor

    def drop(self, rid: ReplicaId) -> None:
        """Forget ``rid`` (it left)."""
        self._raw.pop(rid, None)

    def _rebase(self, now: float) -> None:
        if math.isfinite(now) and now - self._epoch > REBASE_WINDOWS * self.window_s:
            factor = self.scale(now)
            self._raw = {rid: v * factor for rid, v in self._raw.items()}
            self._epoch = now
