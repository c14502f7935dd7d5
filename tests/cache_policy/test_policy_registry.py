"""make_policy: the registry of policies by name."""

from __future__ import annotations

import pytest

from cache_policy.affinity import PrefixAffinityPolicy
from cache_policy.config import PolicyConfig
from cache_policy.least_load import LeastLoadPolicy
from cache_policy.policy import POLICIES, make_policy
from cache_policy.round_robin import RoundRobinPolicy
from cache_policy.types import ReplicaId, ReplicaView


@pytest.mark.parametrize(
    "name, cls",
    [
        ("prefix_affinity", PrefixAffinityPolicy),
        ("round_robin", RoundRobinPolicy),
        ("least_load", LeastLoadPolicy),
    ],
)
def test_make_policy_by_name(name, cls, rng, hreq) -> None:
    policy = make_policy(name, PolicyConfig(), rng)
    assert isinstance(policy, cls) and policy.name == name
    request = hreq([1, 2])
    decision = policy.select(request, [ReplicaView(ReplicaId("a"))])
    assert decision is not None and decision.replica_id == "a"
    policy.on_routed(request, decision)
    policy.on_finished(request, decision.replica_id)
    policy.on_replicas_changed([ReplicaId("a")])


def test_unknown_name_lists_valid_names(rng) -> None:
    with pytest.raises(ValueError, match="least_load, prefix_affinity, round_robin"):
        make_policy("cache_aware", PolicyConfig(), rng)
    assert sorted(POLICIES) == ["least_load", "prefix_affinity", "round_robin"]


def test_duplicate_replica_ids_are_a_value_error(rng, hreq) -> None:
    policy = make_policy("least_load", PolicyConfig(), rng)
    with pytest.raises(ValueError, match="replica_id"):
        policy.select(hreq([1]), [ReplicaView(ReplicaId("a")), ReplicaView(ReplicaId("a"))])
