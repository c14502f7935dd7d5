"""bench.fault_report: the fault run's figures from hand-made records and counters."""

from __future__ import annotations

from bench.fault_load import Record, check_score
from bench.fault_report import Window, duplicate_decodes, moved_sessions, render, summarize
from replicas.metrics import VllmMetrics

V, S = "replica-0", "replica-1"
KILL, BACK = 100.0, 150.0


def rec(kind, key, replica, sent, done, attempt=1, status=200, decoded=48, problem=""):
    return Record(kind, key, status, replica, attempt, sent, done, decoded if status == 200 and not problem else 0,
                  problem)


RECORDS = [
    rec("session", "a", V, 90, 95), rec("session", "a", S, 99, 102, attempt=2), rec("session", "a", S, 103, 104),
    rec("session", "b", V, 96, 98), rec("session", "b", S, 105, 106),
    rec("session", "c", S, 90, 91), rec("session", "c", S, 101, 102),
    rec("session", "d", V, 80, 81), rec("session", "d", "", 101, 101.5, status=502), rec("session", "d", S, 102, 103),
    rec("group", "g", V, 160, 161, decoded=16), rec("group", "g", V, 160, 162, decoded=16),
    rec("score", "p0", S, 100, 101, decoded=3), rec("score", "p1", S, 110, 111, status=503),
    rec("score", "p2", S, 120, 121, decoded=3, problem="partial"),
]


def test_sessions_moved_off_the_killed_replica_count_their_failed_attempts():
    # a: its turn in flight at the kill failed once; b: moved without a failure; c: never on the
    # victim; d: one failed turn, then served elsewhere
    assert moved_sessions(RECORDS, V, KILL) == {0: 1, 1: 2}


def test_duplicate_decodes_compare_replica_counters_with_what_clients_received():
    received_on_s = 48 * 6 + 3  # a's two, b, c's two, d's last, p0 (p2 was partial: not received)
    windows = [Window(S, VllmMetrics(generation_tokens=1000), VllmMetrics(generation_tokens=1000 + received_on_s)),
               Window(V, VllmMetrics(), VllmMetrics(generation_tokens=32), served_since=BACK),
               Window(V, VllmMetrics(generation_tokens=5), VllmMetrics(generation_tokens=999), decodes_checked=False)]
    assert duplicate_decodes(RECORDS, windows) == 0
    windows[0] = Window(S, VllmMetrics(generation_tokens=1000), VllmMetrics(generation_tokens=1010 + received_on_s))
    assert duplicate_decodes(RECORDS, windows) == 10


def test_summary_counts_failures_by_kind_and_status_and_prefilled_tokens():
    windows = [Window(S, VllmMetrics(prompt_tokens=100, prefix_cache_hits=10),
                      VllmMetrics(prompt_tokens=700, prefix_cache_hits=410)),
               Window(V, VllmMetrics(), VllmMetrics(prompt_tokens=50, prefix_cache_hits=0), served_since=BACK)]
    s = summarize("fault", RECORDS, windows, 12.34, V, KILL, BACK)
    assert s.failed == {"score 503": 1, "session 502": 1}
    assert s.scoring_lost_or_partial == 2 and s.scoring_mismatch == 0
    assert (s.prompt_tokens, s.prefilled_tokens) == (650, 650 - 400)
    assert s.kill_to_restarted_s == 50.0 and s.kill_to_served_s == 61.0 and s.wall_s == 12.3
    assert s.requests == {"session": 10, "group": 2, "score": 3}
    assert s.failed_over == 1  # a's turn 99 -> 102, on its second placement
    text = render([s, s], "python -m bench.fault")
    assert "1: 2 sessions" in text and "prefilled tokens, fault / no fault = 1.000" in text


def test_a_scoring_answer_is_whole_or_named():
    responses = [[5, 6], [7]]
    whole = {"results": [{"logprobs": [-1.5, -0.25]}, {"logprobs": [-3.0]}]}
    assert check_score(whole, responses, None) == ""
    assert check_score(whole, responses, [[-1.5, -0.25], [-3.0]]) == ""
    assert check_score(whole, responses, [[-1.5, -0.25], [-3.5]]) == "mismatch"
    assert check_score({"results": [{"logprobs": [-1.5]}, {"logprobs": [-3.0]}]}, responses, None) == "partial"
    assert check_score({"results": [{"logprobs": [-1.5, float("nan")]}, {"logprobs": [-3.0]}]}, responses,
                       None) == "partial"
    assert check_score({"results": whole["results"][:1]}, responses, None) == "partial"
