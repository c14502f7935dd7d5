"""KeyRegistry: sessions and groups in one bounded table, the clock passed in."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cache_policy.registry import KeyRegistry
from cache_policy.types import ReplicaId

A, B = ReplicaId("a"), ReplicaId("b")


def test_live_sessions_drop_idle(fake_clock) -> None:
    reg = KeyRegistry(100, ttl_s=3600)
    t0 = fake_clock.now()
    reg.seen("session", "s1", t0)
    reg.seen("session", "s2", t0 + 60)
    assert reg.is_live("session", "s1", t0 + 120, 120) and not reg.is_live("session", "s1", t0 + 120.5, 120)
    assert reg.is_live("session", "s2", t0 + 120.5, 120)
    reg.seen("session", "s2", t0 + 200)  # seen again: live again for another 120 s
    assert reg.is_live("session", "s2", t0 + 300, 120)
    assert not reg.is_live("group", "s2", t0 + 300, 120)  # kinds are separate
    reg.end("session", "s2")
    assert not reg.is_live("session", "s2", t0 + 300, 120)


def test_pins_count_fan_out_and_never_go_negative() -> None:
    reg = KeyRegistry(100, ttl_s=3600)
    reg.record("group", "g", A)
    reg.started("group", "g", A, 4)  # a scoring fan-out of K = 4
    assert reg.get("group", "g").own_in_flight == 4
    reg.finished("group", "g", A, 3)
    reg.finished("group", "g", A, 3)
    assert reg.get("group", "g").own_in_flight == 0 and reg.get("group", "g").in_flight == 0
    reg.check_integrity()


def test_bounded_lru_keeps_records_in_flight() -> None:
    reg = KeyRegistry(3, ttl_s=3600)
    reg.record("group", "busy", A)
    reg.started("group", "busy", A)
    for i in range(10):
        reg.record("group", f"g{i}", B)
    assert reg.get("group", "busy").replica == A  # in flight: never evicted while idle ones can go
    assert reg.get("group", "g0") is None and reg.get("group", "g9").replica == B
    assert len(reg._records) == 3
    reg.check_integrity()


def test_idle_records_expire_after_the_ttl_but_not_while_in_flight() -> None:
    reg = KeyRegistry(100, ttl_s=10)
    reg.advance(0.0)
    reg.record("session", "idle", A)
    reg.record("session", "running", A)
    reg.started("session", "running", A)
    assert reg.expire(10.0) == 0
    reg.advance(11.0)
    assert reg.expire(11.0) == 1
    assert reg.get("session", "idle") is None and reg.get("session", "running").replica == A


def test_parked_blocks_are_summed_per_replica_and_unparked_when_idle() -> None:
    reg = KeyRegistry(100, ttl_s=3600)
    reg.seen("session", "s1", 0.0)
    reg.park("s1", A, 10)
    reg.seen("session", "s2", 5.0)
    reg.park("s2", A, 7)
    reg.park("s2", B, 3)  # moved: counted on its new replica only
    assert reg.parked_blocks(A) == 10 and reg.parked_blocks(B) == 3
    assert reg.parked_of("s1", A) == 10 and reg.parked_of("s1", B) == 0
    reg.unpark_idle(125.0, 120.0, keep=set())  # s1 last seen at 0: idle; s2 at 5: live
    assert reg.parked_blocks(A) == 0 and reg.parked_blocks(B) == 3
    reg.drop_replica(B)
    assert reg.parked_blocks(B) == 0
    reg.check_integrity()


def test_parked_prefixes_past_the_limit_stop_counting_oldest_parked_first() -> None:
    reg = KeyRegistry(100, ttl_s=3600)
    for sid, blocks in (("s1", 10), ("s2", 20), ("s3", 15)):
        reg.park(sid, A, blocks, limit=40)
    assert reg.parked_blocks(A) == 35 and reg.parked_of("s1", A) == 0  # s1 out: 10 + 20 + 15 > 40
    reg.park("s4", A, 50, limit=40)  # larger than the limit alone: nothing of it counts
    assert reg.parked_blocks(A) == 0
    reg.park("s5", B, 50)  # no limit (replica size unknown)
    assert reg.parked_blocks(B) == 50
    reg.check_integrity()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abcdef"), st.sampled_from([A, B]), st.integers(0, 30),
                          st.sampled_from(["park", "start", "end"])), max_size=40),
       st.integers(0, 60))
def test_parked_sum_stays_within_the_limit_and_keeps_the_newest(ops, limit) -> None:
    reg = KeyRegistry(100, ttl_s=3600)
    for sid, rid, blocks, op in ops:
        if op == "park":
            reg.park(sid, rid, blocks, limit=limit)
            assert reg.parked_blocks(rid) <= limit
            assert reg.parked_of(sid, rid) == (blocks if blocks <= limit else 0)  # the newest stays
        elif op == "start":
            reg.started_session(sid)
        else:
            reg.end("session", sid)
        reg.check_integrity()
