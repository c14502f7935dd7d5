"""Issue 15: placement's load counts the requests the router holds in its admission queue."""

from __future__ import annotations

import random

from cache_policy.config import PolicyConfig
from cache_policy.core import DecisionCore, RequestSpec
from cache_policy.selection import load
from cache_policy.types import ReplicaId, ReplicaView


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(30_000) for _ in range(n)]


def test_load_counts_requests_queued_in_the_router() -> None:
    view = ReplicaView(ReplicaId("a"), in_flight=2, num_waiting=1, queued=5)
    assert load(view) == 8


def test_a_replica_whose_work_waits_in_admission_gets_no_new_key() -> None:
    """Before: queued work was invisible to placement, so the replica with the longest queue
    looked idle and drew the next new keys (at 64 replicas, 4 replicas got 3-6x the mean)."""
    core = DecisionCore(PolicyConfig(balance_abs_threshold=0))
    r0, r1 = ReplicaId("r0"), ReplicaId("r1")
    for rid in (r0, r1):
        core.add_replica(rid, block_size=32, num_gpu_blocks=100)

    def send(n_blocks: int, seed: int, rid: ReplicaId) -> str:
        job = core.open(RequestSpec(tokens(32 * n_blocks, seed)), 0.0)
        assert core.place(job, 0.0, only=rid).replica_id == rid
        return core.admit(job, 0.0).verdict

    assert send(80, 1, r0) == "admit"
    assert [send(40, 2 + i, r0) for i in range(3)] == ["queue"] * 3  # 80 + 40 blocks > 85% of 100
    assert [send(2, 10 + i, r1) for i in range(2)] == ["admit"] * 2
    assert (core._view(r0).in_flight, core._view(r0).queued, core._view(r1).in_flight) == (1, 3, 2)
    fresh = core.open(RequestSpec(tokens(64, 20), session_id="s"), 0.0)
    assert core.place(fresh, 0.0).replica_id == r1  # r0: 1 running + 3 waiting in the router
    core.check_integrity()


def _placed_and_finished(core: DecisionCore, n: int, seed: int, now: float) -> list[str]:
    """Place ``n`` new prompts one after another, each finished at once (load stays 0)."""
    out = []
    for i in range(n):
        job = core.open(RequestSpec(tokens(64, seed + i)), now)
        out.append(core.place(job, now).replica_id)
        core.admit(job, now)
        core.finish(job, "ok", now)
    return out


def _fleet(n: int) -> tuple[DecisionCore, list[ReplicaId]]:
    """A core with lifetime request counts (window 1e9 s) over ``n`` replicas r0..r(n-1)."""
    core = DecisionCore(PolicyConfig(balance_window_s=1e9))
    rids = [ReplicaId(f"r{i}") for i in range(n)]
    for rid in rids:
        core.add_replica(rid, block_size=32, num_gpu_blocks=1000)
    return core, rids


def test_a_replica_back_in_service_is_not_sent_every_new_key_until_level() -> None:
    # r1 is out (unhealthy, then out of rotation) while r0 is sent 40 new prompts; back, it
    # starts level with r0: the next 10 split evenly. Left at its count it took all 10 (and
    # would have taken the next 30), the burst `cache_policy.sent.RecentlySent.level` prevents.
    # r2 is out of service the whole time (sent nothing): it must not set the level
    for take_out, put_back in (
        (lambda core, rid: core.set_health(rid, False), lambda core, rid: core.set_health(rid, True)),
        (lambda core, rid: core.set_rotation(rid, "draining"), lambda core, rid: core.set_rotation(rid, None)),
    ):
        core, (r0, r1, r2) = _fleet(3)
        r3 = ReplicaId("r3")
        take_out(core, r2)
        take_out(core, r1)
        assert set(_placed_and_finished(core, 40, 100, 1.0)) == {r0}
        put_back(core, r1)
        after = _placed_and_finished(core, 10, 200, 2.0)
        assert after.count(r1) in (5, 6), after
        core.add_replica(r3, block_size=32, num_gpu_blocks=1000)  # joins while r2 is still out
        joined = _placed_and_finished(core, 9, 300, 3.0)
        assert joined.count(r3) in (3, 4), joined
        core.check_integrity()


def test_a_replica_put_back_by_another_router_is_levelled_too() -> None:
    # shared state (cache_policy.sharing.apply_versions) can take a replica out of rotation and
    # put it back: the same levelling as set_rotation
    core, (r0, r1) = _fleet(2)
    core.set_rotation(r1, "updating")
    out = core.versions_snapshot()
    core.set_rotation(r1, None)
    back = core.versions_snapshot()
    core.set_rotation(r1, "updating")
    core.apply_versions(out)  # as another router sees it: r1 updating
    assert core.versions.rotation.get(r1) == "updating"
    assert set(_placed_and_finished(core, 40, 100, 1.0)) == {r0}
    core.apply_versions(back)  # another router's snapshot: r1 back in rotation
    assert r1 not in core.versions.rotation
    after = _placed_and_finished(core, 10, 200, 2.0)
    assert after.count(r1) in (5, 6), after
    core.check_integrity()


def test_without_the_levelling_a_returning_replica_takes_every_new_key() -> None:
    # the same run with the hook skipped: what the test above guards against
    core, (r0, r1) = _fleet(2)
    core.set_health(r1, False)
    _placed_and_finished(core, 40, 100, 1.0)
    core.policy.on_service = lambda rid, in_service: None  # type: ignore[method-assign]
    core.set_health(r1, True)
    assert _placed_and_finished(core, 10, 200, 2.0) == [r1] * 10
