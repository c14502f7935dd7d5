"""SessionActivity: which sessions are live, from when each was last seen.

A live session is a continuing session for admission (DESIGN rule 3): its prefix is hot
and costly to lose. Times are float seconds from the caller's clock.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import pairwise

from cache_policy.config import PolicyConfig


class SessionActivity:
    """``session_id -> last seen``, ordered from least to most recently seen.

    Invariant: last-seen times are non-decreasing along the order (``touch`` clamps a
    time that runs behind the latest one up to it, so small skews between callers cannot
    break the order); hence idle sessions are always at the front.
    A session is live while ``now - last_seen <= cfg.session_idle_s``.
    """

    def __init__(self, cfg: PolicyConfig) -> None:
        self.idle_s = cfg.session_idle_s
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._latest = float("-inf")

    def __len__(self) -> int:
        return len(self._seen)

    def touch(self, session_id: str, now: float) -> None:
        """Record that ``session_id`` was seen at ``now``."""
        self._latest = max(self._latest, now)
        self._seen[session_id] = self._latest
        self._seen.move_to_end(session_id)

    def last_seen(self, session_id: str) -> float | None:
        """When ``session_id`` was last seen, or ``None`` if unknown or dropped."""
        return self._seen.get(session_id)

    def is_live(self, session_id: str, now: float) -> bool:
        """Whether ``session_id`` was seen within ``session_idle_s`` of ``now``."""
        seen = self._seen.get(session_id)
        return seen is not None and now - seen <= self.idle_s

    def forget(self, session_id: str) -> None:
        """Drop ``session_id`` (it ended)."""
        self._seen.pop(session_id, None)

    def live_sessions(self, now: float) -> set[str]:
        """The live sessions at ``now``; drops those idle for longer than ``session_idle_s``."""
        while self._seen:
            sid, seen = next(iter(self._seen.items()))
            if now - seen <= self.idle_s:
                break
            del self._seen[sid]
        return set(self._seen)

    def check_integrity(self) -> None:
        """Raise ``RuntimeError('bug: ...')`` if the order is not by last-seen time."""
        times = list(self._seen.values())
        if any(a > b for a, b in pairwise(times)):
            raise RuntimeError("bug: session activity out of last-seen order")
