"""RecentlySent: decayed per-replica request counts, checked against the direct sum."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_policy.sent import REBASE_WINDOWS, RecentlySent

steps = st.lists(st.tuples(st.sampled_from("abc"), st.integers(1, 16), st.floats(0.0, 400.0)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(steps, st.sampled_from([0.5, 7.0, 60.0]))
def test_decayed_counts_equal_the_direct_sum_across_rebases(events, window):
    # times only move forward (the core's clock); a window of 0.5 s over 400 s rebases many times
    sent, now, log = RecentlySent(window), 0.0, []
    for rid, count, dt in events:
        now += dt
        sent.add(rid, count, now)
        log.append((rid, count, now))
    later = now + 3.0
    for rid in "abc":
        want = sum(c * math.exp(-(later - t) / window) for r, c, t in log if r == rid)
        assert sent.get(rid, later) == pytest.approx(want, rel=1e-9, abs=1e-300)
        # the scan's form: stored value times one factor per decision
        assert sent.raw.get(rid, 0.0) * sent.scale(later) == pytest.approx(want, rel=1e-9, abs=1e-300)


def test_the_epoch_moves_before_stored_values_grow_past_exp_of_the_rebase_bound():
    sent = RecentlySent(1.0)
    for t in range(0, 1000, 5):
        sent.add("a", 1, float(t))
        assert sent.raw["a"] < math.exp(REBASE_WINDOWS + 5) * 2
    assert sent.get("a", 995.0) == pytest.approx(1 / (1 - math.exp(-5)), rel=1e-9)


def test_a_clock_never_advanced_means_no_decay_and_level_and_drop():
    sent = RecentlySent(60.0)
    sent.add("a", 4, -math.inf)
    sent.add("b", 1, -math.inf)
    assert (sent.get("a", -math.inf), sent.get("b", -math.inf)) == (4, 1)
    sent.level("c")
    sent.level("a")  # back empty: level with the least-sent other
    assert {r: sent.get(r, -math.inf) for r in sent} == {"a": 1, "b": 1, "c": 1}
    sent.drop("b")
    assert "b" not in sent and sent.get("b", 0.0) == 0.0


@pytest.mark.parametrize("window", [0.0, -1.0, math.nan])
def test_a_window_that_is_not_positive_is_refused(window):
    with pytest.raises(ValueError, match="balance_window_s"):
        RecentlySent(window)


def test_a_clock_that_starts_below_zero_decays_too():
    sent = RecentlySent(300.0)
    sent.add("a", 1, -600.0)
    assert sent.get("a", -300.0) == pytest.approx(math.exp(-1))


def test_undo_takes_a_placement_back_at_its_decayed_value_and_never_below_zero():
    sent = RecentlySent(300.0)
    sent.add("a", 3, 10.0)
    sent.add("a", 2, 40.0)
    sent.undo("a", 2, 40.0)  # undone at once: exactly the 3 of t=10, decayed to t=40
    assert sent.get("a", 40.0) == pytest.approx(3 * math.exp(-30 / 300), rel=1e-12)
    sent.undo("a", 5, 41.0)
    assert sent.get("a", 41.0) == 0.0
    sent.undo("z", 1, 41.0)  # never sent anything: nothing to take back, no entry made
    assert "z" not in sent
