"""DecisionCore and the version contract (issue 10): strict jobs never run on weights they were not
salted for, an update's rotation sends queued jobs back, preempted jobs come back to the same
replica without counting a failure, and a job admitted across the start of an update is not sent.

Driven the way ``router.lifecycle`` drives the core, on a fake clock.
"""

from __future__ import annotations

import pytest

from cache_policy.config import PolicyConfig
from cache_policy.core import DecisionCore, RequestSpec
from cache_policy.hashing import block_hashes
from cache_policy.types import ReplicaId

A, B = ReplicaId("a"), ReplicaId("b")
PROMPT = list(range(2000, 2100))


def fleet(policy: str = "salt", **cfg) -> DecisionCore:
    core = DecisionCore(PolicyConfig(**{"queue_timeout_s": 5.0, **cfg}), weight_update_policy=policy)
    for rid in (A, B):
        core.add_replica(rid, block_size=32, num_gpu_blocks=400)
    return core


def update(core: DecisionCore, rid: ReplicaId, version: int) -> None:
    core.version_loaded(rid, version)
    core.finish_update(version, core.versions.policy)


def test_a_request_tagged_for_a_version_nobody_serves_is_resalted_for_the_one_that_computes_it():
    core = fleet("salt")
    update(core, A, 1)
    update(core, B, 1)
    job = core.open(RequestSpec(PROMPT, session_id="s", weight_version=0), 0.0)
    assert job.salt == "rr:v0"
    decision = core.place(job, 0.0)
    assert decision is not None and job.weight_version == 1
    assert (job.salt, job.choice.salt_version) == ("rr:v1", 1)  # salt names the weights that run it
    assert job.view.block_hashes == tuple(block_hashes(PROMPT, 32, "rr:v1"))
    assert core.kv_versions(job) == [1]
    assert core.registry.get("session", "s").start_version == 1


def test_while_one_replica_still_serves_the_old_version_the_tagged_request_goes_there():
    core = fleet("salt")
    update(core, A, 1)
    job = core.open(RequestSpec(PROMPT, weight_version=0), 0.0)
    assert core.place(job, 0.0).replica_id == B and job.salt == "rr:v0" and job.weight_version == 0
    new = core.open(RequestSpec(PROMPT), 0.0)
    assert core.place(new, 0.0).replica_id == A and new.salt == "rr:v1"


def test_scoring_under_keep_plus_salt_ignores_the_session_start_and_stays_on_its_version():
    core = fleet("keep+salt")
    gen = core.open(RequestSpec(PROMPT, session_id="s"), 0.0)
    core.place(gen, 0.0)
    core.finish(gen, "ok", 0.0)
    update(core, A, 1)  # B still on v0
    turn = core.open(RequestSpec(PROMPT, session_id="s"), 1.0)
    assert turn.salt == "rr:v0" and not turn.choice.pins_version  # the allowed hybrid: continuing
    score = core.open(RequestSpec(PROMPT, session_id="s", kind="score", fan_out=2), 1.0)
    assert score.salt == "rr:v1" and core.place(score, 1.0).replica_id == A
    assert core.kv_versions(score) == [1] and score.weight_version == 1


def test_taking_a_replica_out_sends_its_queue_back_and_a_late_admit_is_not_dispatchable():
    core = fleet("salt", max_queue=8, max_queue_per_replica=0)
    core.set_health(B, False)
    big = core.open(RequestSpec(list(range(30_000)) [:12_000], new_tokens=400), 0.0)
    core.place(big, 0.0)
    assert core.admit(big, 0.0).verdict == "admit"
    queued = core.open(RequestSpec(list(range(50_000, 62_000)), new_tokens=400), 0.0)
    core.place(queued, 0.0)
    assert core.admit(queued, 0.0).verdict == "queue"
    core.set_rotation(A, "updating")
    back = core.pump(0.1)
    assert [(j.id, a.verdict) for j, a in back] == [(queued.id, "replica_gone")]
    assert not core.dispatchable(big)  # admitted before, not yet sent: must be placed again
    core.finish(big, "preempted", 0.2)
    assert not big.done and big.tried == [] and core.replicas[A].failures == 0 and core.in_flight(A) == 0
    core.set_rotation(A, None)
    update(core, A, 1)
    assert core.place(big, 0.3).replica_id == A  # the same replica, after its update
    assert big.weight_version == 1 and big.salt == "rr:v1" and core.dispatchable(big)


def test_a_preempted_job_keeps_its_place_in_no_tried_list_and_counts_no_failure():
    core = fleet("keep", failures_out_of_rotation=1)
    job = core.open(RequestSpec(PROMPT), 0.0)
    rid = core.place(job, 0.0).replica_id
    core.admit(job, 0.0)
    core.finish(job, "preempted", 0.0)
    assert core.replicas[rid].healthy and job.tried == [] and not job.done
    core.check_integrity()


@pytest.mark.parametrize("initial", [0, None])
def test_a_restarted_replica_serves_the_initial_version_whatever_it_had_loaded(initial):
    # a restart starts the engine from the replicas' model (a fresh attacker saw a replica
    # restarted after an update serve seed 0 while its answers claimed version 1)
    core = DecisionCore(PolicyConfig(), weight_update_policy="keep", initial_version=initial)
    for rid in (A, B):
        core.add_replica(rid, block_size=16, num_gpu_blocks=100)
    for rid in (A, B):
        update(core, rid, 1)
    core.restarted(A, num_gpu_blocks=100)
    assert core.versions.loaded[A] == initial and core.versions.loaded[B] == 1
    job = core.open(RequestSpec(list(range(64))), 0.0)
    core.place(job, 0.0)
    assert core.kv_versions(job) == ([] if job.replica_id == A and initial is None else
                                     [initial] if job.replica_id == A else [0, 1] if initial == 0 else [1])
    core.check_integrity()


def test_a_keep_plus_salt_turn_tagged_with_its_session_start_version_continues_on_the_session_salt():
    # a fresh new user's MED: RL clients tag every request with the version they sampled from; a
    # turn tagged with the session's own start version, after an update, was made strict: it was
    # re-salted for the new version (its cached prefix lost) and the session re-based
    core = fleet("keep+salt")
    first = core.open(RequestSpec(PROMPT, session_id="s", weight_version=0), 0.0)
    assert first.choice.pins_version  # a new session's first turn is strict for its tag
    core.place(first, 0.0)
    core.finish(first, "ok", 0.0)
    update(core, A, 1)
    update(core, B, 1)
    turn = core.open(RequestSpec(PROMPT + [7] * 40, session_id="s", weight_version=0), 1.0)
    assert turn.salt == "rr:v0" and not turn.choice.pins_version
    assert core.place(turn, 1.0).replica_id == first.replica_id  # session affinity holds
    assert turn.view.block_hashes == tuple(block_hashes(PROMPT + [7] * 40, 32, "rr:v0"))
    assert core.kv_versions(turn) == [0, 1]  # the allowed hybrid: v1's weights over v0's KV
    assert core.registry.get("session", "s").start_version == 0  # not re-based
    core.finish(turn, "ok", 1.0)
    later = core.open(RequestSpec(PROMPT + [7] * 80, session_id="s"), 2.0)
    assert later.salt == "rr:v0"
    # a new session tagged with the old version is still strict, and re-salted for v1
    other = core.open(RequestSpec(PROMPT, session_id="t", weight_version=0), 2.0)
    core.place(other, 2.0)
    assert (other.salt, other.weight_version) == ("rr:v1", 1) and other.choice.pins_version
    core.check_integrity()


def test_a_score_resalted_for_the_served_version_leaves_its_session_start_alone():
    # a fresh attacker: a /v1/score tagged with the session's start version, after an update,
    # is strict and re-salted for the version served; it also re-based the session's start, so
    # the session's next turn lost its salt and its cached prefix (scoring never inherits a
    # session's start, so it must not move it either)
    core = fleet("keep+salt")
    first = core.open(RequestSpec(PROMPT, session_id="s"), 0.0)
    core.place(first, 0.0)
    core.finish(first, "ok", 0.0)
    update(core, A, 1)
    update(core, B, 1)
    score = core.open(RequestSpec(PROMPT, session_id="s", kind="score", fan_out=2, weight_version=0), 1.0)
    core.place(score, 1.0)
    assert (score.salt, score.weight_version) == ("rr:v1", 1)
    core.finish(score, "ok", 1.0)
    assert core.registry.get("session", "s").start_version == 0
    turn = core.open(RequestSpec(PROMPT + [5] * 40, session_id="s", weight_version=0), 2.0)
    assert turn.salt == "rr:v0" and not turn.choice.pins_version
    core.check_integrity()
