"""DecisionCore methods for several routers (issue 13): version snapshots, peer loads, pins.

Pure: two cores stand for two routers; what one publishes is handed to the other as the
router's state layer would after a JSON round trip.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cache_policy.config import PolicyConfig
from cache_policy.core import DecisionCore, ReplicaLoad, RequestSpec
from cache_policy.salts import cache_salt_for_version
from cache_policy.sharing import PeerLoad, VersionSnapshot, rendezvous, sum_peer_loads
from cache_policy.types import ReplicaId

R0, R1 = ReplicaId("r0"), ReplicaId("r1")


def router(**kw) -> DecisionCore:
    core = DecisionCore(PolicyConfig(queue_timeout_s=5.0, session_idle_s=10.0), **kw)
    for rid in (R0, R1):
        core.add_replica(rid, block_size=32, num_gpu_blocks=100)
    return core


def wire(snapshot: VersionSnapshot) -> VersionSnapshot:
    """Through JSON, as Redis carries it."""
    return VersionSnapshot.from_json(json.loads(json.dumps(snapshot.as_json())))


def placed(core, spec, now=0.0):
    job = core.open(spec, now)
    assert core.place(job, now) is not None
    return job


def test_an_update_on_one_core_reaches_the_other_with_rotation_but_not_draining():
    a, b = router(), router()
    old_session = placed(b, RequestSpec(list(range(64)), session_id="s-old"))
    b.finish(old_session, "ok", 0.0)
    b.set_rotation(R1, "draining")
    a.set_rotation(R0, "updating")
    assert b.apply_versions(wire(a.versions_snapshot())) == []
    assert b.versions.rotation == {R0: "updating", R1: "draining"}
    a.version_loaded(R0, 5)
    a.finish_update(5, "keep+salt")
    a.set_rotation(R0, None)
    assert b.apply_versions(wire(a.versions_snapshot())) == [R0]
    assert (b.versions.current, b.versions.loaded[R0], b.versions.loaded[R1]) == (5, 5, 0)
    assert b.versions.rotation == {R1: "draining"}
    new = b.open(RequestSpec(list(range(64)), session_id="s-new"), 1.0)
    kept = b.open(RequestSpec(list(range(64)), session_id="s-old"), 1.0)
    assert new.salt == cache_salt_for_version(5) and kept.salt == cache_salt_for_version(0)


def test_a_malformed_snapshot_is_refused_and_changes_nothing():
    b = router()
    with pytest.raises(ValueError, match="weight_update_policy"):
        VersionSnapshot.from_json({"policy": "bogus", "current": 3, "loaded": {"r0": 3}})
    with pytest.raises(ValueError, match="malformed"):
        VersionSnapshot.from_json({"policy": "salt", "current": 3})
    assert b.versions.current == 0 and b.versions.loaded[R0] == 0


def test_unconfirmed_versions_salt_nothing_with_a_guess():
    core = router()
    core.unconfirm_versions()
    untagged = core.open(RequestSpec(list(range(64))), 0.0)
    tagged = core.open(RequestSpec(list(range(64)), weight_version=7), 0.0)
    assert untagged.salt is None and untagged.choice.version is None
    assert tagged.salt == cache_salt_for_version(7)
    core.apply_versions(VersionSnapshot.from_json({"current": 2, "policy": "keep+salt", "history": [0, 2],
                                                   "loaded": {"r0": 2, "r1": 2}}))
    assert core.open(RequestSpec(list(range(64))), 0.0).salt == cache_salt_for_version(2)


def test_peer_shares_fold_into_admission_so_two_routers_respect_one_watermark(fake_clock):
    alone, shared = router(), router()
    spec = RequestSpec(list(range(32 * 40)))  # 40 of 100 blocks; watermark 0.85
    peer = {R0: PeerLoad(requests=2, committed=50, unseen=50), R1: PeerLoad(requests=2, committed=50, unseen=50)}
    shared.set_peer_loads(peer)
    assert shared.replica_view(R0).in_flight == 2 and shared.replica_view(R0).kv_cache_usage == pytest.approx(0.5)
    verdicts = []
    for core in (alone, shared):
        job = placed(core, spec, fake_clock.now())
        verdicts.append(core.admit(job, fake_clock.now()).verdict)
    assert verdicts == ["admit", "queue"]  # 0.4 alone; 0.5 + 0.4 = 0.9 > 0.85 with the peer's share
    assert shared.own_loads()[R0 if shared.queue_length() == 0 else R1].requests == 0
    assert sum_peer_loads([peer, {R0: PeerLoad(1, 2, 3)}])[R0] == PeerLoad(3, 52, 53)


def test_following_another_routers_pin_moves_the_job_its_pins_and_its_index_entries():
    core = router()
    prompt = list(range(128))
    job = placed(core, RequestSpec(prompt, session_id="s", group_id="g"))
    here = job.replica_id
    there = R1 if here == R0 else R0
    decision = core.follow_pin(job, there, 0.0)
    assert decision is not None and job.replica_id == there and decision.reason.value == "session"
    assert core.registry.get("session", "s").replica == there and core.registry.get("group", "g").replica == there
    assert core.prefix_index().match(job.view.block_hashes).get(here, 0) == 0
    assert core.prefix_index().match(job.view.block_hashes)[there] == 4  # 128 tokens: 4 full blocks indexed
    assert core.admit(job, 0.0).verdict == "admit"
    core.finish(job, "ok", 0.0)
    assert core.in_flight(there) == 0 and core.registry.get("session", "s").in_flight == 0
    core.check_integrity()


def test_a_winner_this_router_cannot_use_is_not_followed():
    core = router()
    job = placed(core, RequestSpec(list(range(64)), group_id="g"))
    other = R1 if job.replica_id == R0 else R0
    core.set_health(other, False)
    assert core.follow_pin(job, other, 0.0) is None and core.follow_pin(job, ReplicaId("r9"), 0.0) is None
    assert job.replica_id != other and core.registry.get("group", "g").replica == job.replica_id


def test_adopted_pins_carry_their_start_version_and_are_listed():
    core = router()
    core.finish_update(3, "keep+salt")
    core.version_loaded(R0, 3)
    core.version_loaded(R1, 3)
    core.adopt_pin("session", "s", R1, start_version=0, now=0.0)
    job = core.open(RequestSpec(list(range(64)), session_id="s"), 0.0)
    assert job.salt == cache_salt_for_version(0)
    assert core.place(job, 0.0).replica_id == R1
    assert ("session", "s", R1, 0) in core.pins()


def test_without_shared_state_routers_agree_on_a_new_keys_replica_and_keep_known_pins():
    a, b = router(), router()
    b.observe_load(R0, ReplicaLoad(num_waiting=50), 0.0)  # their own load views differ
    spread = set()
    for g in range(40):
        pa, pb = a.pin_by_hash("group", f"g{g}", 0.0), b.pin_by_hash("group", f"g{g}", 0.0)
        assert pa == pb == rendezvous(f"group:g{g}", [R0, R1])
        job = placed(b, RequestSpec(list(range(64)), group_id=f"g{g}"))
        assert job.replica_id == pb
        spread.add(pa)
    assert spread == {R0, R1}
    known = placed(a, RequestSpec(list(range(64)), session_id="s"))
    assert a.pin_by_hash("session", "s", 1.0) == known.replica_id  # a pin it knows is kept
    a.set_rotation(R1, "updating")
    assert a.pin_by_hash("group", "fresh", 1.0) == R0


def test_rendezvous_moves_only_the_keys_of_a_removed_replica():
    three = [R0, R1, ReplicaId("r2")]
    before = {k: rendezvous(k, three) for k in map(str, range(300))}
    after = {k: rendezvous(k, three[:2]) for k in before}
    assert all(after[k] == v for k, v in before.items() if v != "r2")
    assert rendezvous("x", []) is None


@given(st.lists(st.integers(0, 60), max_size=30), st.lists(st.integers(0, 60), max_size=30), st.booleans())
def test_applied_history_is_the_union_of_both_whether_or_not_the_snapshot_only_adds(mine, theirs, extends):
    # a snapshot that only adds to this router's history (the common case, taken without a set
    # merge) and one that does not (a router that forgot or never saw some versions) both give
    # the ascending union: requests resolve alike on every router
    from cache_policy.sharing import apply_versions
    from cache_policy.versions import VersionBook

    book = VersionBook("keep", None)
    book.history[:] = sorted(set(mine))
    history = sorted(set(mine) | set(theirs)) if extends else sorted(set(theirs))
    apply_versions(book, VersionSnapshot(None, "keep", tuple(history)), [])
    assert book.history == sorted(set(mine) | set(history))
