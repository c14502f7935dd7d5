"""RoundRobinPolicy and LeastLoadPolicy: the two cache-blind baselines."""

from __future__ import annotations

import random
from collections import Counter

from cache_policy.config import PolicyConfig
from cache_policy.least_load import LeastLoadPolicy
from cache_policy.round_robin import RoundRobinPolicy
from cache_policy.types import RouteReason


def test_round_robin_cycles_over_healthy(new_fleet, hreq, rng) -> None:
    fleet = new_fleet(["a", "b", "c"])
    policy = RoundRobinPolicy(PolicyConfig(), rng)
    picks = [fleet.route(policy, hreq([1])).replica_id for _ in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]
    fleet.set("b", healthy=False)
    picks = [fleet.route(policy, hreq([1])) for _ in range(4)]
    assert [d.replica_id for d in picks] == ["a", "c", "a", "c"]
    assert {d.reason for d in picks} == {RouteReason.ROUND_ROBIN}


def test_round_robin_none_when_no_healthy(new_fleet, hreq, rng) -> None:
    fleet = new_fleet(["a", "b"], healthy=False)
    assert RoundRobinPolicy(PolicyConfig(), rng).select(hreq([1]), fleet.list()) is None
    assert RoundRobinPolicy(PolicyConfig(), rng).select(hreq([1]), []) is None


def test_least_load_picks_min_load(new_fleet, hreq, rng) -> None:
    fleet = new_fleet(["a", "b", "c"])
    fleet.set("a", in_flight=3)
    fleet.set("b", in_flight=1, num_waiting=2)
    fleet.set("c", in_flight=2)
    decision = LeastLoadPolicy(PolicyConfig(), rng).select(hreq([1]), fleet.list())
    assert decision is not None
    assert (decision.replica_id, decision.reason) == ("c", RouteReason.LOAD)


def test_least_load_ties_broken_by_rng(new_fleet, hreq) -> None:
    fleet = new_fleet(["a", "b"])
    firsts = Counter()
    for seed in range(40):
        policy = LeastLoadPolicy(PolicyConfig(), random.Random(seed))
        firsts[policy.select(hreq([1]), fleet.list()).replica_id] += 1
    assert firsts["a"] > 5 and firsts["b"] > 5


def test_least_load_skips_unhealthy_and_none(new_fleet, hreq, rng) -> None:
    fleet = new_fleet(["a", "b"])
    fleet.set("b", healthy=False)
    policy = LeastLoadPolicy(PolicyConfig(), rng)
    fleet.set("a", in_flight=50)
    assert policy.select(hreq([1]), fleet.list()).replica_id == "a"
    fleet.set("a", healthy=False)
    assert policy.select(hreq([1]), fleet.list()) is None
