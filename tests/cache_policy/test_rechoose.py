"""A job whose salt was chosen before a weight update takes the present policy's salt when it is
placed again (``DecisionCore._rechoose``): a fresh attacker's score, opened under ``flush`` and
rerun after a ``keep`` update, reused the old weights' unsalted KV (4.7 nats off)."""

from __future__ import annotations

import pytest

from cache_policy.config import PolicyConfig
from cache_policy.core import DecisionCore, RequestSpec
from cache_policy.hashing import block_hashes
from cache_policy.salts import cache_salt_for_version

PROMPT = list(range(100, 164))


def fleet(policy: str) -> DecisionCore:
    c = DecisionCore(PolicyConfig(), weight_update_policy=policy, initial_version=0)
    c.add_replica("r0", block_size=16, num_gpu_blocks=1000)
    c.version_loaded("r0", 0)
    return c


def run_then_update(c: DecisionCore, spec: RequestSpec, policy: str):
    job = c.open(spec, 1.0)
    c.place(job, 1.0)
    assert c.admit(job, 1.0).verdict == "admit"
    c.finish(job, "preempted", 2.0)  # the update took it back before anything reached the client
    c.version_loaded("r0", 1)
    c.finish_update(1, policy)
    c.place(job, 3.0)
    return job


@pytest.mark.parametrize("new_policy", ["keep", "salt", "keep+salt"])
def test_a_score_opened_under_flush_and_run_again_after_an_update_is_salted_by_the_new_version(new_policy):
    # scoring is strict under every policy but flush (README "Version contract")
    c = fleet("flush")
    job = run_then_update(c, RequestSpec(PROMPT, kind="score", fan_out=4), new_policy)
    salt = cache_salt_for_version(1)
    assert job.choice.salt == salt and job.choice.version == 1 and job.choice.pins_version
    assert job.view.block_hashes == tuple(block_hashes(PROMPT, 16, salt))
    assert c.kv_versions(job) == [1]  # never hybrid


@pytest.mark.parametrize("new_policy, salted", [("salt", True), ("keep+salt", True), ("keep", False), ("flush", False)])
def test_a_completion_opened_unsalted_takes_the_new_policys_salt_when_run_again(new_policy, salted):
    c = fleet("flush")
    job = run_then_update(c, RequestSpec(PROMPT, new_tokens=8), new_policy)
    assert job.choice.salt == (cache_salt_for_version(1) if salted else None)
    assert job.view.block_hashes == tuple(block_hashes(PROMPT, 16, job.choice.salt))


def test_a_strict_job_keeps_its_version_while_a_replica_still_serves_it():
    # salted by its own version (pinned): it goes on to a replica still on that version (the rolling
    # update's other half); only when none is left does _settle_version move it
    c = fleet("salt")
    c.add_replica("r1", block_size=16, num_gpu_blocks=1000)
    c.version_loaded("r1", 0)
    job = c.open(RequestSpec(PROMPT, new_tokens=8), 1.0)
    c.place(job, 1.0)
    c.finish(job, "preempted", 2.0)
    c.version_loaded("r0", 1)
    c.finish_update(1, "salt")
    c.place(job, 3.0)
    assert job.choice.salt == cache_salt_for_version(0) and job.replica_id == "r1"


def test_nothing_changes_without_an_update():
    c = fleet("flush")
    job = c.open(RequestSpec(PROMPT, kind="score", fan_out=2), 1.0)
    before = (job.choice, job.view)
    c.place(job, 1.0)
    assert (job.choice, job.view) == before
