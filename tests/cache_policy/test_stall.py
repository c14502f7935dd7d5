"""``DecisionCore.stalled``: an engine that holds requests and finishes no token for
``policy.stall_timeout_s`` (a hung engine behind a live API server), from scrapes alone."""

from __future__ import annotations

import pytest

from cache_policy.config import PolicyConfig
from cache_policy.core import DecisionCore, ReplicaLoad


def core(timeout_s: float = 10.0) -> DecisionCore:
    c = DecisionCore(PolicyConfig(stall_timeout_s=timeout_s))
    c.add_replica("r0", block_size=16, num_gpu_blocks=100)
    return c


def load(running: int, tokens: int, waiting: int = 0) -> ReplicaLoad:
    return ReplicaLoad(0.1, running, waiting, 100, 0, tokens)


def test_holding_work_with_frozen_counters_for_the_timeout_is_a_stall():
    c = core()
    c.observe_load("r0", load(2, 500), 0.0)
    c.observe_load("r0", load(2, 500), 9.0)
    assert not c.stalled("r0", 9.9)
    c.observe_load("r0", load(2, 500), 10.0)
    assert c.stalled("r0", 10.0)  # 10 s since the scrape that last saw progress
    c.observe_load("r0", load(2, 501), 11.0)  # one token: moving again
    assert not c.stalled("r0", 11.0) and not c.stalled("r0", 20.9) and c.stalled("r0", 21.0)


@pytest.mark.parametrize("running, waiting", [(0, 0)])
def test_an_idle_engine_is_never_stalled_however_long_its_counters_stand(running, waiting):
    c = core()
    for t in range(0, 100, 5):
        c.observe_load("r0", load(running, 500, waiting), float(t))
    assert not c.stalled("r0", 100.0)
    c.observe_load("r0", load(0, 500, 3), 101.0)  # waiting requests count as held work
    assert not c.stalled("r0", 110.0) and c.stalled("r0", 111.0)


def test_a_replica_in_a_weight_update_is_paused_on_purpose_not_stalled():
    c = core()
    c.observe_load("r0", load(1, 7), 0.0)
    c.set_rotation("r0", "updating")
    c.observe_load("r0", load(1, 7), 30.0)
    assert not c.stalled("r0", 35.0)
    c.set_rotation("r0", None)  # back: the timeout counts from its last scrape in the update
    c.observe_load("r0", load(1, 7), 36.0)
    assert not c.stalled("r0", 39.9) and c.stalled("r0", 40.0)


def test_a_restart_starts_the_count_again_and_unknown_replicas_and_the_rule_off_say_no():
    c = core()
    c.observe_load("r0", load(1, 7), 0.0)
    c.restarted("r0", num_gpu_blocks=100)
    assert not c.stalled("r0", 50.0)  # no scrape since the restart
    c.observe_load("r0", load(1, 7), 50.0)  # counters from the new engine: the first scrape starts the count
    assert not c.stalled("r0", 59.0) and c.stalled("r0", 60.0)
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
    # nothing running, so the requests sent there since are what shows it holds work
    from cache_policy.core import RequestSpec

    c = core()
    c.observe_load("r0", load(0, 500), 0.0)
    job = c.open(RequestSpec(list(range(40)), None, None, None, None, "generate", 1), 1.0)
    c.place(job, 1.0)
    assert c.admit(job, 1.0).verdict == "admit"
    c.settle()
    c.observe_load("r0", load(0, 500), 2.0)  # the first scrape that sees it holding work
    assert not c.stalled("r0", 11.9)
    c.observe_load("r0", load(0, 500), 12.0)
    assert c.stalled("r0", 12.0)
    c.finish(job, "failed", 12.5)  # taken back (the router runs it elsewhere)
    c.observe_load("r0", load(0, 500), 13.0)
    assert not c.stalled("r0", 13.0)  # holds nothing: back (the next request sent there tells)
