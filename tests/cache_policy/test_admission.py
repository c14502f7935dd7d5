"""Admission: projected usage, admit/queue/reject, service order, fairness, expiry."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_policy.admission import (
    AdmissionQueue,
    AdmissionRequest,
    blocks_needed,
    classify,
    queue_capacity,
    fits,
    projected_usage,
)
from cache_policy.config import PolicyConfig
from cache_policy.types import ReplicaId, ReplicaView

A, B = ReplicaId("a"), ReplicaId("b")


def view(rid: str = "a", **kw) -> ReplicaView:
    kw.setdefault("in_flight", 1)
    kw.setdefault("num_gpu_blocks", 100)
    return ReplicaView(ReplicaId(rid), **kw)


def ar(
    rid: str = "a",
    blocks: int = 10,
    prio: str = "new",
    sid: str | None = None,
    t: float = 0.0,
    rid_: str = "",
):
    return AdmissionRequest(ReplicaId(rid), blocks, prio, sid, t, rid_)  # type: ignore[arg-type]


def test_projected_usage() -> None:
    assert projected_usage(view(kv_cache_usage=0.5, num_gpu_blocks=1000), 100, 50) == 0.65
    assert projected_usage(view(num_gpu_blocks=0), 100, 50) is None
    with pytest.raises(ValueError, match="pending_blocks"):
        projected_usage(view(), -1, 0)


def test_blocks_needed_and_classify() -> None:
    assert blocks_needed(100, 2, 32) == 2  # ceil(100 / 32) = 4 blocks, 2 hit
    assert blocks_needed(64, 5, 32) == 0
    with pytest.raises(ValueError, match="block_size"):
        blocks_needed(10, 0, 0)
    assert classify(True, True) == "continuing_session"
    assert classify(False, True) == "group_member"
    assert classify(False, False) == "new"


def test_fits() -> None:
    cfg = PolicyConfig()
    ok, reason, usage = fits(view(kv_cache_usage=0.8), 0, 5, cfg)  # 0.8 + 0.05 == watermark
    assert (ok, reason, usage) == (True, "under_watermark", pytest.approx(0.85))
    assert fits(view(kv_cache_usage=0.8), 1, 5, cfg)[:2] == (False, "kv_watermark")
    assert fits(view(in_flight=0, kv_cache_usage=0.0), 0, 500, cfg)[:2] == (True, "idle")
    assert fits(view(num_gpu_blocks=0, in_flight=255), 0, 5, cfg) == (
        True,
        "under_in_flight_cap",
        None,
    )
    assert fits(view(num_gpu_blocks=0, in_flight=256), 0, 5, cfg)[:2] == (False, "in_flight_cap")


def test_request_validation() -> None:
    with pytest.raises(ValueError, match="session_id"):
        ar(prio="continuing_session")
    with pytest.raises(ValueError, match="new_blocks"):
        ar(blocks=-1)
    with pytest.raises(ValueError, match="priority"):
        ar(prio="urgent")


def test_admit_queue_reject() -> None:
    q = AdmissionQueue(PolicyConfig(max_queue=2, max_queue_per_replica=0, queue_timeout_s=30.0))
    full = view(kv_cache_usage=0.8)
    assert q.admit(ar(blocks=5), full, 0).verdict == "admit"
    d = q.admit(ar(blocks=10, t=0.0), full, 0)
    assert (d.verdict, d.reason, d.retry_after_s) == ("queue", "kv_watermark", None)
    assert d.projected_usage == pytest.approx(0.9)
    assert q.admit(ar(blocks=10, t=4.0), full, 0).verdict == "queue"
    rejected = q.admit(ar(blocks=10, t=10.0), full, 0)
    assert (rejected.verdict, rejected.reason, rejected.retry_after_s) == (
        "reject",
        "queue_full",
        20.0,
    )
    assert len(q) == 2
    q.check_integrity()


def test_zero_queue_rejects_at_once() -> None:
    q = AdmissionQueue(PolicyConfig(max_queue=0, max_queue_per_replica=0))
    d = q.admit(ar(blocks=50), view(kv_cache_usage=0.8), 0)
    assert d.verdict == "reject" and d.retry_after_s == 30.0


def test_full_queue_displaces_lower_priority() -> None:
    q = AdmissionQueue(PolicyConfig(max_queue=2, max_queue_per_replica=0))
    full = view(kv_cache_usage=0.9)
    n1, g1 = ar(prio="new", rid_="n1"), ar(prio="group_member", rid_="g1")
    q.admit(n1, full, 0)
    q.admit(g1, full, 0)
    d = q.admit(ar(prio="continuing_session", sid="s", rid_="c1"), full, 0)
    assert d.verdict == "queue" and d.displaced is n1
    d = q.admit(ar(prio="group_member", sid=None, rid_="g2"), full, 0)
    assert d.verdict == "reject"  # nothing below group_member is queued any more
    d = q.admit(ar(prio="continuing_session", sid="t", rid_="c2"), full, 0)
    assert d.displaced is g1
    assert [r.request_id for r in q.waiting()] == ["c1", "c2"]


def test_no_overtaking_on_the_same_replica() -> None:
    q = AdmissionQueue(PolicyConfig())
    q.admit(ar(prio="continuing_session", sid="s", blocks=50), view(kv_cache_usage=0.5), 0)
    small = q.admit(ar(blocks=1), view(kv_cache_usage=0.5), 0)
    assert (small.verdict, small.reason) == ("queue", "queued_behind")
    assert q.admit(ar("b", blocks=1), view("b", kv_cache_usage=0.5), 0).verdict == "admit"
    higher = q.admit(ar(prio="continuing_session", sid="t", blocks=1), view(kv_cache_usage=0.5), 0)
    assert higher.reason == "queued_behind"  # same class waits its turn too


def test_service_order() -> None:
    q = AdmissionQueue(PolicyConfig())
    full = view(kv_cache_usage=1.0)
    arrivals = [
        ar(prio="new", rid_="n1"),
        ar(prio="continuing_session", sid="s1", rid_="s1a"),
        ar(prio="group_member", rid_="g1"),
        ar(prio="continuing_session", sid="s2", rid_="s2a"),
        ar(prio="continuing_session", sid="s1", rid_="s1b"),
        ar(prio="new", rid_="n2"),
        ar(prio="continuing_session", sid="s3", rid_="s3a"),
        ar(prio="group_member", rid_="g2"),
    ]
    for r in arrivals:
        q.admit(r, full, 0)
    order = [r.request_id for r in q.waiting()]
    assert order == ["s1a", "s2a", "s3a", "s1b", "g1", "g2", "n1", "n2"]


def test_pop_admissible_respects_capacity_and_order() -> None:
    q = AdmissionQueue(PolicyConfig(high_watermark=0.85))
    busy = view(kv_cache_usage=1.0)
    for name, blocks, rid in [
        ("x", 20, "a"),
        ("y", 10, "a"),
        ("z", 10, "a"),
        ("w", 1, "a"),
        ("v", 30, "b"),
    ]:
        q.admit(ar(rid, blocks=blocks, rid_=name), view(rid, kv_cache_usage=1.0), 0)
    assert len(q) == 5 and busy.kv_cache_usage == 1.0
    # a: room for 0.85 - 0.50 = 35 blocks: x (20) + y (10) fit, z would make 40;
    # w (1) must not overtake z
    replicas = [view("a", kv_cache_usage=0.5), view("b", kv_cache_usage=0.2)]
    popped = q.pop_admissible(replicas, {B: 40}, now=1.0)
    assert [r.request_id for r in popped] == ["x", "y"]  # b: 0.2 + (40 + 30) / 100 > 0.85
    assert [r.request_id for r in q.waiting()] == ["z", "w", "v"]
    popped = q.pop_admissible(
        [view("a", kv_cache_usage=0.5), view("b", kv_cache_usage=0.2)], {}, now=2.0
    )
    assert [r.request_id for r in popped] == ["z", "w", "v"]
    q.check_integrity()


def test_pop_admissible_counts_each_engine_request_of_a_fan_out_against_the_in_flight_cap() -> None:
    # capacity unknown (no block count): the in-flight cap decides. x stands for 3 engine requests
    # (n = 3 samples or a K = 3 fan-out); with 1 already in flight and a cap of 4, y no longer fits
    # in the same pass: 1 + 3 = 4 engine requests are in flight once x runs
    q = AdmissionQueue(PolicyConfig(max_in_flight_per_replica=4))
    full = view("a", in_flight=4, num_gpu_blocks=0)
    q.admit(AdmissionRequest(A, 1, "new", None, 0.0, "x", requests=3), full, 0)
    q.admit(AdmissionRequest(A, 1, "new", None, 0.0, "y"), full, 0)
    popped = q.pop_admissible([view("a", in_flight=1, num_gpu_blocks=0)], {}, now=1.0)
    assert [r.request_id for r in popped] == ["x"]
    assert [r.request_id for r in q.waiting()] == ["y"]
    assert [r.request_id for r in q.pop_admissible([view("a", in_flight=3, num_gpu_blocks=0)], {}, now=2.0)] == ["y"]


def test_pop_admissible_round_robin_over_sessions() -> None:
    q = AdmissionQueue(PolicyConfig())
    for name, sid in [("s1a", "s1"), ("s1b", "s1"), ("s1c", "s1"), ("s2a", "s2")]:
        q.admit(
            ar(prio="continuing_session", sid=sid, blocks=10, rid_=name),
            view(kv_cache_usage=1.0),
            0,
        )
    room_for_one = [view(kv_cache_usage=0.7)]  # 15 blocks of room
    served = [q.pop_admissible(room_for_one, {}, now=1.0)[0].request_id for _ in range(4)]
    assert served == ["s1a", "s2a", "s1b", "s1c"]
    assert len(q) == 0


def test_pop_admissible_leaves_unhealthy_and_absent_replicas() -> None:
    q = AdmissionQueue(PolicyConfig())
    q.admit(ar("a", rid_="ra"), view("a", kv_cache_usage=1.0), 0)
    q.admit(ar("b", rid_="rb"), view("b", kv_cache_usage=1.0), 0)
    assert q.pop_admissible([view("a", healthy=False, kv_cache_usage=0.0)], {}, now=1.0) == []
    dropped = q.drop_replica(B)
    assert [r.request_id for r in dropped] == ["rb"] and len(q) == 1


def test_expire() -> None:
    q = AdmissionQueue(PolicyConfig(queue_timeout_s=30.0))
    for t in (0.0, 10.0, 20.0):
        q.admit(ar(t=t, rid_=f"t{t:g}"), view(kv_cache_usage=1.0), 0)
    popped = q.pop_admissible([view(in_flight=0, kv_cache_usage=0.8)], {}, now=35.0)
    assert [r.request_id for r in popped] == ["t10"]  # idle replica: one; t0 already expired
    assert [r.request_id for r in q.expire(35.0)] == ["t0"]
    assert [r.request_id for r in q.expire(50.0)] == []
    assert [r.request_id for r in q.expire(50.1)] == ["t20"]
    assert len(q) == 0


def test_admit_checks_the_replica_matches() -> None:
    with pytest.raises(ValueError, match="replica"):
        AdmissionQueue(PolicyConfig()).admit(ar("a"), view("b"), 0)


def test_queue_bound_grows_with_the_fleet() -> None:
    cfg = PolicyConfig(max_queue=256, max_queue_per_replica=64)
    assert (queue_capacity(cfg, 1), queue_capacity(cfg, 4), queue_capacity(cfg, 64)) == (256, 256, 4096)
    q = AdmissionQueue(PolicyConfig(max_queue=1, max_queue_per_replica=2))
    q.replicas = 2
    full = view(kv_cache_usage=1.0)
    assert [q.admit(ar(rid_=str(i)), full, 0).verdict for i in range(5)] == ["queue"] * 4 + ["reject"]
    q.replicas = 1  # a replica left: the queue keeps what it holds, takes no more
    q.check_integrity()
    assert q.admit(ar(rid_="x"), full, 0).verdict == "reject"


def test_retry_after_follows_the_recent_wait_once_requests_were_admitted_from_the_queue() -> None:
    q = AdmissionQueue(PolicyConfig(queue_timeout_s=30.0))
    q.admit(ar(blocks=50, t=0.0), view(kv_cache_usage=0.8), 0)
    assert q.retry_after_s(10.0) == 20.0  # no wait seen yet: the oldest request's expiry
    [req] = q.pop_admissible([view(kv_cache_usage=0.0)], {}, 4.0)  # waited 4 s
    assert q.retry_after_s(10.0) == 4.0
    q.admit(ar(blocks=50, t=10.0), view(kv_cache_usage=0.8), 0)
    q.pop_admissible([view(kv_cache_usage=0.0)], {}, 10.5)  # waited 0.5 s: 4 + 0.1 * (0.5 - 4)
    assert q.retry_after_s(11.0) == pytest.approx(3.65)
    q.admit(ar(blocks=50, t=11.0), view(kv_cache_usage=0.8), 0)
    q.pop_admissible([view(kv_cache_usage=0.0)], {}, 11.0)
    assert q.retry_after_s(11.0) == pytest.approx(3.285) and q.retry_after_s(99.0) >= 1.0


def test_a_member_of_a_running_group_is_taken_past_a_blocked_replica() -> None:
    q = AdmissionQueue(PolicyConfig())
    full = view(kv_cache_usage=0.9)
    big = AdmissionRequest(ReplicaId("a"), 50, "continuing_session", "s", 0.0, "big")
    member = AdmissionRequest(ReplicaId("a"), 5, "group_member", None, 0.0, "m", group_id="g")
    loner = AdmissionRequest(ReplicaId("a"), 5, "group_member", None, 0.0, "l", group_id="h")
    for r in (big, member, loner):
        q.admit(r, full, 0)
    taken = q.pop_admissible([full], {}, 1.0, group_running=lambda g, rid: g == "g")
    assert taken == [member] and [r.request_id for r in q.waiting()] == ["big", "l"]
    assert q.admit(AdmissionRequest(ReplicaId("a"), 5, "group_member", None, 1.0, "m2", group_id="g"),
                   full, 0, with_group=True).verdict == "admit"


_STORE_OPS = st.lists(st.tuples(st.booleans(), st.sampled_from(["r0", "r1", "r2"]),
                                st.sampled_from(["continuing_session", "group_member", "new"]),
                                st.sampled_from(["s1", "s2"]), st.integers(0, 30), st.integers(0, 9)), max_size=40)


@settings(max_examples=200, deadline=None)
@given(ops=_STORE_OPS)
def test_has_waiting_is_a_scan_of_the_queue(ops):
    """``AdmissionQueueStore.has_waiting`` (per-replica class counts, read on every admission) and
    ``oldest_enqueued_at`` (kept as requests come and go, read by every expiry) say what a scan of
    the queued requests says, after any pushes and removals (arrival times in any order)."""
    from cache_policy.admission_queue import PRIORITIES, AdmissionQueueStore, AdmissionRequest

    store, queued = AdmissionQueueStore(), []
    for push, rid, priority, session, pick, at in ops:
        if push or not queued:
            req = AdmissionRequest(rid, priority=priority, session_id=session if priority == "continuing_session" else None,
                                   group_id="g" if priority == "group_member" else None, enqueued_at=float(at))
            store.push(req)
            queued.append(req)
        else:
            store.remove([queued.pop(pick % len(queued))], served=bool(pick % 2))
        store.check_integrity()
        assert store.oldest_enqueued_at() == min((q.enqueued_at for q in queued), default=None)
        for r in ("r0", "r1", "r2", "r9"):
            for k, p in enumerate(PRIORITIES):
                want = any(q.replica_id == r and PRIORITIES.index(q.priority) <= k for q in queued)
                assert store.has_waiting(r, p) == want
