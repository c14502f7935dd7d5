"""``DecisionCore.stalled``: an engine that holds requests and finishes no token for
``policy.stall_timeout_s`` (a hung engine behind a live API server), from scrapes alone; out for
the timeout, doubled per stall in a row (at most ``MAX_STALL_TIMEOUTS``), back at once when a
token moves."""

from __future__ import annotations

import pytest

from cache_policy.config import PolicyConfig
from cache_policy.core import MAX_STALL_TIMEOUTS, DecisionCore, ReplicaLoad, RequestSpec


def core(timeout_s: float = 10.0) -> DecisionCore:
    # probes off: these tests are the half-open breaker (the next request sent there tells);
    # with probes on (the default) a probe tells instead (the tests at the end)
    c = DecisionCore(PolicyConfig(stall_timeout_s=timeout_s, stall_probe_after_s=0.0))
    c.add_replica("r0", block_size=16, num_gpu_blocks=100)
    return c


def load(running: int, tokens: int, waiting: int = 0) -> ReplicaLoad:
    return ReplicaLoad(0.1, running, waiting, 100, 0, tokens)


def test_holding_work_with_frozen_counters_for_the_timeout_is_a_stall_and_a_token_ends_it():
    c = core()
    c.observe_load("r0", load(2, 500), 0.0)
    c.observe_load("r0", load(2, 500), 9.0)
    assert not c.stalled("r0", 9.9)
    c.observe_load("r0", load(2, 500), 10.0)  # 10 s since the scrape that last saw progress
    assert c.stalled("r0", 10.0) and c.stalled("r0", 19.9) and not c.stalled("r0", 20.0)
    c.observe_load("r0", load(2, 501), 11.0)  # one token: moving again, back at once
    assert not c.stalled("r0", 11.0)
    c.observe_load("r0", load(2, 501), 20.9)
    assert not c.stalled("r0", 20.9)
    c.observe_load("r0", load(2, 501), 21.0)
    assert c.stalled("r0", 21.0) and not c.stalled("r0", 31.0)  # a first stall again: one timeout


def test_stalls_in_a_row_without_progress_double_the_time_out_up_to_the_cap():
    # an engine hung while idle, scraped every second: while it is out it holds nothing (its
    # requests were taken back), once back a request is sent there and hangs; it is out for 10,
    # 20, 40, 80, 80, ... s, back for a timeout between
    c = core()
    runs, out_since = [], None
    for t in range(0, 900):
        c.observe_load("r0", load(0 if c.stalled("r0", float(t)) else 1, 7), float(t))
        out = c.stalled("r0", float(t))
        if out and out_since is None:
            out_since = t
        elif not out and out_since is not None:
            runs.append(t - out_since)
            out_since = None
    assert runs[:4] == [10, 20, 40, 80], runs
    assert runs[4:] == [10 * MAX_STALL_TIMEOUTS] * len(runs[4:]) and len(runs) >= 6, runs


def test_an_idle_engine_is_never_stalled_however_long_its_counters_stand():
    c = core()
    for t in range(0, 100, 5):
        c.observe_load("r0", load(0, 500), float(t))
    assert not c.stalled("r0", 100.0)
    c.observe_load("r0", load(0, 500, 3), 101.0)  # waiting requests count as held work
    c.observe_load("r0", load(0, 500, 3), 110.0)
    assert not c.stalled("r0", 110.0)
    c.observe_load("r0", load(0, 500, 3), 111.0)
    assert c.stalled("r0", 111.0)


def test_a_replica_in_a_weight_update_is_paused_on_purpose_not_stalled():
    c = core()
    c.observe_load("r0", load(1, 7), 0.0)
    c.set_rotation("r0", "updating")
    c.observe_load("r0", load(1, 7), 30.0)
    assert not c.stalled("r0", 30.0)
    c.set_rotation("r0", None)  # back: the timeout counts from its last scrape in the update
    c.observe_load("r0", load(1, 7), 36.0)
    c.observe_load("r0", load(1, 7), 39.9)
    assert not c.stalled("r0", 39.9)
    c.observe_load("r0", load(1, 7), 40.0)
    assert c.stalled("r0", 40.0)
    c.set_rotation("r0", "updating")  # an update begun meanwhile: its pause is on purpose
    assert not c.stalled("r0", 41.0)


def test_a_restart_starts_the_count_again_and_unknown_replicas_and_the_rule_off_say_no():
    c = core()
    c.observe_load("r0", load(1, 7), 0.0)
    c.observe_load("r0", load(1, 7), 10.0)
    assert c.stalled("r0", 10.0)
    c.restarted("r0", num_gpu_blocks=100)
    assert not c.stalled("r0", 10.0)  # a new engine
    c.observe_load("r0", load(1, 7), 50.0)  # its first scrape starts the count
    c.observe_load("r0", load(1, 7), 59.0)
    assert not c.stalled("r0", 59.0)
    c.observe_load("r0", load(1, 7), 60.0)
    assert c.stalled("r0", 60.0) and not c.stalled("r0", 70.0)  # the restart forgot the stalls before
    assert not c.stalled("nope", 1e9)
    off = core(0.0)
    off.observe_load("r0", load(1, 7), 0.0)
    off.observe_load("r0", load(1, 7), 1e6)
    assert not off.stalled("r0", 1e6)


def test_the_timeout_must_not_be_negative():
    with pytest.raises(ValueError, match="stall_timeout_s"):
        PolicyConfig(stall_timeout_s=-1)


def test_an_engine_hung_while_idle_is_caught_by_the_requests_this_router_has_in_flight_there():
    # vLLM updates its gauges from engine steps: an engine that hung while idle keeps showing
    # nothing running, so the requests sent there since are what shows it holds work; once they
    # are taken back it holds nothing, is back after its stall, and a request sent there then
    # stalls again (for twice as long)
    c = core()
    c.observe_load("r0", load(0, 500), 0.0)

    def send(now: float):
        job = c.open(RequestSpec(list(range(40)), None, None, None, None, "generate", 1), now)
        c.place(job, now)
        assert c.admit(job, now).verdict == "admit"
        c.settle()
        return job

    job = send(1.0)
    c.observe_load("r0", load(0, 500), 2.0)  # the first scrape that sees it holding work
    c.observe_load("r0", load(0, 500), 11.9)
    assert not c.stalled("r0", 11.9)
    c.observe_load("r0", load(0, 500), 12.0)
    assert c.stalled("r0", 12.0)
    c.finish(job, "failed", 12.5)  # taken back (the router runs it elsewhere)
    c.observe_load("r0", load(0, 500), 13.0)
    assert c.stalled("r0", 21.9) and not c.stalled("r0", 22.0)  # out for its stall, holding nothing
    c.observe_load("r0", load(0, 500), 22.0)
    job = send(23.0)  # back: the next request tells
    for t in (24.0, 33.0, 34.0):
        c.observe_load("r0", load(0, 500), t)
    assert c.stalled("r0", 34.0) and c.stalled("r0", 53.9) and not c.stalled("r0", 54.0)


def test_an_engine_showing_requests_it_never_finishes_stays_out():
    c = core()
    out = []
    for t in range(0, 500):
        c.observe_load("r0", load(2, 7), float(t))
        out.append(c.stalled("r0", float(t)))
    assert not any(out[:10]) and all(out[10:])


def test_a_restart_is_due_at_the_configured_stall_in_a_row_and_a_token_in_between_resets_the_count():
    # hung while holding a request it never finishes: stalls at 10, 20 (10 + 10), 40 (20 + 20) s
    c = DecisionCore(PolicyConfig(stall_timeout_s=10.0, stall_restart_after=3))
    c.add_replica("r0", block_size=16, num_gpu_blocks=100)
    due = []
    for t in range(0, 60):
        c.observe_load("r0", load(1, 7), float(t))
        if c.restart_due("r0", float(t)):
            due.append(t)
    assert due[0] == 40 and c.replicas["r0"].stalls == 3, due  # the third stall, not before
    # one token between two stalls starts the count again: never three in a row
    c = DecisionCore(PolicyConfig(stall_timeout_s=10.0, stall_restart_after=3))
    c.add_replica("r0", block_size=16, num_gpu_blocks=100)
    tokens = 7
    for t in range(0, 200):
        if t % 30 == 25:
            tokens += 1  # the engine is slow, not hung: a token every 30 s (two stalls between)
        c.observe_load("r0", load(1, tokens), float(t))
        assert not c.restart_due("r0", float(t)), t
    assert c.replicas["r0"].stalls == 2
    never = DecisionCore(PolicyConfig(stall_timeout_s=10.0, stall_restart_after=0))
    never.add_replica("r0", block_size=16, num_gpu_blocks=100)
    for t in range(0, 400):
        never.observe_load("r0", load(1, 7), float(t))
        assert not never.restart_due("r0", float(t))
    assert never.replicas["r0"].stalls >= 4 and not never.restart_due("nope", 0.0)
    with pytest.raises(ValueError, match="stall_restart_after"):
        PolicyConfig(stall_restart_after=-1)


def test_requests_whose_answer_reaches_the_client_are_not_held_work_a_slow_reader_stalls_nothing():
    # a stream the engine finished stays in flight while its client reads slowly; the engine is
    # idle (its gauges say 0) and healthy: it must not be found stalled nor restarted. A request
    # not answering yet (sent to an engine that may never have seen it) still counts.
    c = core()
    c.observe_load("r0", load(0, 500), 0.0)
    jobs = []
    for n in (1, 8):  # a plain request and an n = 8 completion (8 engine requests)
        job = c.open(RequestSpec(list(range(40 + n)), None, None, None, None, "generate", 1, fan_out=n), 0.5)
        c.place(job, 0.5)
        assert c.admit(job, 0.5).verdict == "admit"
        c.settle()
        jobs.append(job)
    for job in jobs:
        c.answering(job)
        c.answering(job)  # idempotent
    assert c.replicas["r0"].answering == 9
    c.check_integrity()
    for t in range(1, 200, 5):
        c.observe_load("r0", load(0, 500), float(t))
        assert not c.stalled("r0", float(t)) and not c.restart_due("r0", float(t)), t
    late = c.open(RequestSpec(list(range(90)), None, None, None, None, "generate", 1), 200.0)
    c.place(late, 200.0)
    assert c.admit(late, 200.0).verdict == "admit"
    c.settle()
    for t in (201.0, 210.0, 211.0):  # one request not answering: held work again
        c.observe_load("r0", load(0, 500), t)
    assert c.stalled("r0", 211.0)
    for job in jobs:
        c.finish(job, "ok", 212.0)
    assert c.replicas["r0"].answering == 0
    c.check_integrity()


def test_a_request_taken_back_from_a_stalled_replica_is_placed_elsewhere_and_counts_no_failure():
    c = DecisionCore(PolicyConfig(stall_timeout_s=10.0, failures_out_of_rotation=1))
    for rid in ("r0", "r1"):
        c.add_replica(rid, block_size=16, num_gpu_blocks=100)
    job = c.open(RequestSpec(list(range(40)), None, None, None, None, "generate", 1), 0.0)
    c.place(job, 0.0)
    assert c.admit(job, 0.0).verdict == "admit"
    first = job.replica_id
    c.finish(job, "abandoned", 1.0)
    assert not job.done and job.tried == [first] and job.abandoned == 1
    assert c.replicas[first].failures == 0 and c.replicas[first].healthy  # one failure would take it out here
    c.place(job, 1.0)
    assert job.replica_id != first  # elsewhere
    assert c.admit(job, 1.0).verdict == "admit"
    c.finish(job, "ok", 2.0)
    assert job.done and c.replicas[first].failures == 0  # not a suspect either
    c.check_integrity()


def test_an_idle_engine_gets_a_probe_and_one_hung_while_idle_stalls_on_it_and_is_restarted():
    # an engine hung while idle shows its last numbers and answers /health: without a probe the
    # first client request sent there waits out the stall timeout; with one, the stall rule finds
    # it (and, at policy.stall_restart_after, has it restarted) while no client waits
    c = DecisionCore(PolicyConfig(stall_timeout_s=10.0, stall_probe_after_s=30.0, stall_restart_after=3))
    c.add_replica("r0", block_size=16, num_gpu_blocks=100)
    assert not c.probe_due("r0", 0.0)  # never scraped: nothing known
    c.observe_load("r0", load(0, 500), 0.0)
    assert not c.probe_due("r0", 29.0) and c.probe_due("r0", 30.0)
    # a healthy engine answers it: its tokens move, the next probe is due a period later
    c.probe_sent("r0", 30.0)
    assert not c.probe_due("r0", 31.0)  # one at a time
    c.probe_ended("r0", True)
    for t in range(31, 62):  # scraped every second, idle
        c.observe_load("r0", load(0, 502), float(t))
        assert c.probe_due("r0", float(t)) == (t >= 61) and not c.stalled("r0", float(t))
    # now it hangs: the probe never ends; held work with no token is a stall, three in a row a restart
    c.probe_sent("r0", 61.0)
    restart_at = None
    for t in range(62, 400):
        c.observe_load("r0", load(0, 502), float(t))
        if c.restart_due("r0", float(t)):
            restart_at = t
            break
        assert not c.probe_due("r0", float(t))  # never a second probe beside the first
    assert c.replicas["r0"].stalls == 3 and restart_at == 61 + 10 + 10 + 20, restart_at
    c.restarted("r0", num_gpu_blocks=100)
    assert not c.replicas["r0"].probing and not c.probe_due("r0", 1000.0)  # a fresh engine: scraped first


def test_no_probe_while_busy_out_of_rotation_or_with_the_rule_off():
    c = DecisionCore(PolicyConfig(stall_timeout_s=10.0, stall_probe_after_s=30.0))
    c.add_replica("r0", block_size=16, num_gpu_blocks=100)
    c.observe_load("r0", load(1, 500), 0.0)  # running a request (a long prefill: no token counted yet)
    assert not c.probe_due("r0", 40.0)
    c.observe_load("r0", load(0, 500), 1.0)
    c.set_rotation("r0", "updating")
    assert not c.probe_due("r0", 40.0)
    c.set_rotation("r0", None)
    assert c.probe_due("r0", 40.0)
    c.set_health("r0", False)
    assert not c.probe_due("r0", 40.0)
    for cfg in (PolicyConfig(stall_timeout_s=0.0), PolicyConfig(stall_probe_after_s=0.0)):
        off = DecisionCore(cfg)
        off.add_replica("r0", block_size=16, num_gpu_blocks=100)
        off.observe_load("r0", load(0, 500), 0.0)
        assert not off.probe_due("r0", 1e6)
    c.probe_ended("gone", True)  # a replica that left: ignored
    c.probe_sent("gone", 40.0)


def _probing_core(**cfg) -> DecisionCore:
    c = DecisionCore(PolicyConfig(**{"stall_timeout_s": 10.0, "stall_probe_after_s": 30.0, "stall_restart_after": 0, **cfg}))
    c.add_replica("r0", block_size=16, num_gpu_blocks=100)
    return c


def test_with_probes_a_stall_ends_only_when_a_probe_is_answered_or_a_token_moves():
    # a fresh attacker: at the end of each stall of an engine hung while idle, client requests
    # were sent there again and each waited out the stall timeout (the half-open breaker); with
    # probes on, the probe tells instead, and the replica stays out until it is answered
    c = _probing_core()
    for t in range(0, 31):  # idle, scraped every second
        c.observe_load("r0", load(0, 500), float(t))
    c.probe_sent("r0", 30.0)
    for t in range(31, 41):
        c.observe_load("r0", load(0, 500), float(t))
    assert c.stalled("r0", 40.0) and c.replicas["r0"].stalls == 1
    c.probe_ended("r0", False)  # its probe timed out: still hung
    for t in range(41, 60):
        c.observe_load("r0", load(0, 500), float(t))
        assert c.stalled("r0", float(t))  # past its stall's time (50 s) too: out until told
        assert c.probe_due("r0", float(t)) == (t >= 50)
    c.probe_sent("r0", 59.0)  # the probe at the stall's end: hung still, a second stall
    for t in range(60, 70):
        c.observe_load("r0", load(0, 500), float(t))
    assert c.replicas["r0"].stalls == 2 and c.stalled("r0", 69.0)
    c.probe_ended("r0", True)  # answered: the engine moves again, back at once
    assert not c.stalled("r0", 69.0) and c.replicas["r0"].stalls == 0
    c.observe_load("r0", load(0, 502), 70.0)
    assert not c.stalled("r0", 70.0) and not c.probe_due("r0", 99.0) and c.probe_due("r0", 100.0)


def test_a_probe_that_tells_nothing_leaves_the_half_open_breaker_and_probes_stay_one_a_period():
    c = _probing_core()
    for t in range(0, 31):
        c.observe_load("r0", load(0, 500), float(t))
    c.probe_sent("r0", 30.0)
    for t in range(31, 41):
        c.observe_load("r0", load(0, 500), float(t))
    assert c.stalled("r0", 40.0)
    c.probe_ended("r0", None)  # refused, or no connection: nothing known of the engine
    assert c.stalled("r0", 49.9) and not c.stalled("r0", 50.0)  # the stall ends at its time
    # a server whose counters never move (answered probes, no token counted): one probe a period
    c2 = _probing_core()
    sent = []
    for t in range(0, 200):
        c2.observe_load("r0", load(0, 500), float(t))
        if c2.probe_due("r0", float(t)):
            c2.probe_sent("r0", float(t))
            sent.append(t)
            c2.probe_ended("r0", True)
    assert sent == [30, 60, 90, 120, 150, 180], sent

