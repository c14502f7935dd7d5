"""WeightVersions: salts by policy, step tags without churn, session starts, routing exclusions."""

from __future__ import annotations

import pytest

from cache_policy.config import PolicyConfig
from cache_policy.types import ReplicaId
from replicas.replica_set import ReplicaEndpoint
from router.parse import RoutingKeys
from router.pool import ReplicaPool
from router.versions import WeightVersions

A, B = ReplicaId("replica-0"), ReplicaId("replica-1")


def make(policy: str = "keep+salt", initial: int | None = 0) -> WeightVersions:
    pool = ReplicaPool([ReplicaEndpoint(r, f"http://127.0.0.1:{9 + i}", 32, 100, "m") for i, r in enumerate((A, B))])
    return WeightVersions(pool, policy, initial, PolicyConfig(session_idle_s=10.0))  # type: ignore[arg-type]


def update(v: WeightVersions, version: int, policy: str | None = None) -> None:
    for rid in (A, B):
        v.set_loaded(rid, version)
    v.finish_update(version, policy or v.policy)


def test_step_tags_without_a_weight_change_keep_one_salt():
    v = make("salt")
    salts = {v.assign(RoutingKeys(weight_version=step), 0.0).salt for step in (None, 0, 3, 9)}
    assert salts == {"rr:v0"}
    update(v, 10)
    assert v.assign(RoutingKeys(weight_version=12), 1.0).salt == "rr:v10"
    assert v.assign(RoutingKeys(), 1.0).salt == "rr:v10"
    assert v.assign(RoutingKeys(weight_version=7), 1.0).salt == "rr:v0"  # tagged with the old version


@pytest.mark.parametrize("policy", ["flush", "keep"])
def test_flush_and_keep_send_no_salt(policy):
    v = make(policy)
    choice = v.assign(RoutingKeys(session_id="s"), 0.0)
    assert choice.salt is None and choice.version == 0 and v.excluded(choice) == []


def test_keep_plus_salt_sessions_keep_their_start_salt_new_ones_get_the_new():
    v = make("keep+salt")
    assert v.assign(RoutingKeys(session_id="old", group_id="g"), 0.0).salt == "rr:v0"
    update(v, 1)
    kept = v.assign(RoutingKeys(session_id="old", weight_version=1), 1.0)
    assert (kept.salt, kept.salt_version, kept.version) == ("rr:v0", 0, 1)
    assert v.assign(RoutingKeys(group_id="g"), 1.0).salt == "rr:v0"  # the group started before too
    assert v.assign(RoutingKeys(session_id="new"), 1.0).salt == "rr:v1"
    assert v.assign(RoutingKeys(group_id="g2"), 1.0).salt == "rr:v1"
    assert v.assign(RoutingKeys(session_id="old"), 20.0).salt == "rr:v1"  # idle past session_idle_s: afresh


def test_salt_policy_resalts_continuing_sessions():
    v = make("salt")
    v.assign(RoutingKeys(session_id="s"), 0.0)
    update(v, 1)
    assert v.assign(RoutingKeys(session_id="s"), 1.0).salt == "rr:v1"


def test_salted_requests_go_to_replicas_serving_their_version():
    v = make("salt")
    v.set_loaded(A, 1)  # rolling update: A done, B still on 0
    v.finish_update(1, "salt")
    new = v.assign(RoutingKeys(), 0.0)
    assert new.salt == "rr:v1" and v.excluded(new) == [B]
    old = v.assign(RoutingKeys(weight_version=0), 0.0)
    assert old.salt == "rr:v0" and v.excluded(old) == [A]
    v.take_out([A], "updating")
    assert v.excluded(new) == [A]  # nobody in rotation serves v1: only rotation applies
    assert v.updating()
    v.put_back(A)
    assert not v.updating()


def test_version_log_reports_mixed_versions():
    v = make()
    mark = v.mark(A)
    assert v.versions_since(A, mark) == [0]
    v.set_loaded(A, 1)
    assert v.versions_since(A, mark) == [0, 1]
    assert v.versions_since(A, v.mark(A)) == [1]
    assert v.pool.get(A).weight_version == 1


def test_unknown_initial_version_means_no_salt_until_an_update():
    v = make("salt", initial=None)
    assert v.assign(RoutingKeys(), 0.0).salt is None
    update(v, 3)
    assert v.assign(RoutingKeys(), 0.0).salt == "rr:v3"
    with pytest.raises(ValueError, match="weight_update_policy"):
        make("salted")
