"""bench.soak: the decision core over many simulated trainer steps keeps every part of its state
within its bound, leaves nothing behind once the traffic stops, and the verdicts say so."""

from __future__ import annotations

from bench.soak import PER_REQUEST, Soak, SoakConfig, bounds, verdicts
from cache_policy.config import PolicyConfig
from cache_policy.core import DecisionCore, RequestSpec
from cache_policy.versions import LOG_KEPT


def test_a_soak_with_an_update_every_step_restarts_and_churn_stays_bounded():
    cfg = SoakConfig(steps=400, replicas=4, sessions=12, group_size=4, update_every=1, restart_every=90,
                     churn_every=150, checkpoints=4, policy=PolicyConfig(max_pins=2_000, max_index_blocks=20_000))
    result = Soak(cfg).run()
    verdict = verdicts(result, cfg)
    assert set(verdict.values()) <= {"bounded", "drained", "per version"}, verdict
    drained = result["drained"]
    assert {name: drained[name] for name in PER_REQUEST} == dict.fromkeys(PER_REQUEST, 0)
    assert drained["parked"] == 0  # every session ended, by its word or by going idle
    assert drained["history"] == cfg.steps + 1  # versions 0..400, one per update and the initial one
    # every replica's log was cut (401 versions each), and stays within its bound
    assert drained["version_log"] <= 2 * LOG_KEPT * cfg.replicas < drained["history"] * cfg.replicas
    assert drained["replicas"] == cfg.replicas and result["requests"] == 400 * (12 + 4 + 1 + 2)  # per step: a turn per session, a group, a fan-out, two one-offs
    for c in result["checkpoints"]:
        for name, (bound, _) in bounds(cfg).items():
            assert bound is None or c["sizes"][name] <= bound, (c["step"], name)


def test_verdicts_name_a_part_that_grows_passes_its_bound_or_is_left_behind():
    cfg = SoakConfig(replicas=2, policy=PolicyConfig(max_pins=100))
    sizes = lambda k: {"keys": 10 * k, "parked": 5 * k * k, "tickets": 0, "history": k, "cached_versions": 2 * k}
    result = {"checkpoints": [{"sim_s": k, "sizes": sizes(k)} for k in range(1, 13)],
              "drained": {**sizes(12), "tickets": 3}}
    assert verdicts(result, cfg) == {"keys": "OVER BOUND", "parked": "GROWS", "tickets": "LEFT BEHIND",
                                     "history": "per version", "cached_versions": "per version"}


def test_state_sizes_count_a_queued_and_an_admitted_request_and_drop_them_when_they_end():
    core = DecisionCore(PolicyConfig(max_queue=8, max_queue_per_replica=8))
    core.add_replica("a", block_size=16, num_gpu_blocks=20)
    first = core.open(RequestSpec(list(range(100, 228)), session_id="s", new_tokens=16), 0.0)  # 9 blocks at peak
    core.place(first, 0.0)
    assert core.admit(first, 0.0).verdict == "admit"  # an idle replica admits anything
    second = core.open(RequestSpec(list(range(300, 428)), new_tokens=16), 0.0)
    core.place(second, 0.0)
    assert core.admit(second, 0.0).verdict == "queue"  # 9 + 9 blocks past 0.85 of 20: it waits
    sizes = core.state_sizes()
    assert (sizes["tickets"], sizes["queued"], sizes["jobs_queued"], sizes["keys"]) == (1, 1, 1, 1)
    assert sizes["held_blocks"] == 8  # the first prompt's 128 tokens: 8 full blocks
    core.finish(second, "cancelled", 1.0)
    core.finish(first, "ok", 1.0)
    sizes = core.state_sizes()
    assert (sizes["tickets"], sizes["queued"], sizes["jobs_queued"], sizes["held_blocks"]) == (0, 0, 0, 0)
    assert sizes["parked"] == 1  # the session's prefix, parked between turns


def test_under_flush_each_replica_caches_one_version_and_an_idle_core_lets_keys_go():
    cfg = SoakConfig(steps=120, replicas=3, sessions=6, group_size=2, weight_policy="flush", restart_every=0,
                     churn_every=0, checkpoints=3, policy=PolicyConfig(key_ttl_s=600.0))
    result = Soak(cfg).run()
    assert [c["sizes"]["cached_versions"] for c in result["checkpoints"]] == [3, 3, 3]  # reset at every update
    assert result["drained"]["history"] == 121
    assert result["drained"]["keys"] == 0  # past key_ttl_s with nothing in flight: a pump sweeps them
    assert set(verdicts(result, cfg).values()) <= {"bounded", "drained", "per version"}
