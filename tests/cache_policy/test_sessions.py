"""SessionActivity: live sessions by last-seen time, with the clock passed in."""

from __future__ import annotations

from cache_policy.admission import SessionActivity
from cache_policy.config import PolicyConfig


def test_live_sessions_drop_idle(fake_clock) -> None:
    sessions = SessionActivity(PolicyConfig(session_idle_s=120.0))
    t0 = fake_clock.now()
    sessions.touch("s1", t0)
    sessions.touch("s2", t0 + 60)
    assert sessions.live_sessions(t0 + 120) == {"s1", "s2"}
    assert sessions.is_live("s1", t0 + 120) and not sessions.is_live("s1", t0 + 120.5)
    assert sessions.live_sessions(t0 + 120.5) == {"s2"}
    assert len(sessions) == 1 and sessions.last_seen("s1") is None
    sessions.touch("s2", t0 + 200)  # seen again: live again for another 120 s
    assert sessions.live_sessions(t0 + 300) == {"s2"}
    sessions.forget("s2")
    assert sessions.live_sessions(t0 + 300) == set()


def test_skewed_times_keep_order() -> None:
    sessions = SessionActivity(PolicyConfig(session_idle_s=10.0))
    sessions.touch("a", 100.0)
    sessions.touch("b", 99.0)  # a caller whose clock ran slightly behind
    assert sessions.last_seen("b") == 100.0
    sessions.check_integrity()
    assert sessions.live_sessions(110.0) == {"a", "b"}
    assert sessions.live_sessions(110.5) == set()
