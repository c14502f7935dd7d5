"""DecisionCore admission: admit, queue, pump, 429s, parked sessions (pure, fake clock).

Ported from the router's former AdmissionController tests: same scenarios, same numbers. One
replica of 100 blocks of 32 tokens; a request of ``n`` blocks has ``32 n`` prompt tokens and
asks for no new tokens, so it holds exactly ``n`` blocks at its peak.
"""

from __future__ import annotations

import itertools

import pytest

from cache_policy.config import PolicyConfig
from cache_policy.core import DecisionCore, ReplicaLoad, RequestSpec
from cache_policy.types import ReplicaId

A = ReplicaId("replica-0")
_fresh = itertools.count(1)


def make(blocks: int = 100, enabled: bool = True, **policy) -> DecisionCore:
    cfg = PolicyConfig(**{"queue_timeout_s": 5.0, "session_idle_s": 10.0, **policy})
    core = DecisionCore(cfg, admission=enabled, initial_version=None)
    core.add_replica(A, block_size=32, num_gpu_blocks=blocks)
    return core


def tokens(blocks: int, prefix: list[int] | None = None) -> list[int]:
    """``prefix`` then fresh tokens up to ``32 * blocks`` (fresh: shares nothing with other calls)."""
    base = next(_fresh) * 100_000
    prefix = prefix or []
    return prefix + [base + i for i in range(32 * blocks - len(prefix))]


def ask(core, clock, blocks, session=None, group=None, prompt=None):
    job = core.open(RequestSpec(prompt or tokens(blocks), session, group), clock.now())
    assert core.place(job, clock.now()) is not None
    return job, core.admit(job, clock.now())


def test_admits_under_the_watermark_and_queues_above(fake_clock):
    core = make()
    first, a1 = ask(core, fake_clock, 50)
    second, a2 = ask(core, fake_clock, 30)  # 0.8 <= 0.85
    third, a3 = ask(core, fake_clock, 10)  # 0.9 > 0.85
    assert (a1.verdict, a2.verdict, a3.verdict) == ("admit", "admit", "queue")
    assert core.pump(fake_clock.now()) == [] and core.queue_length() == 1
    core.finish(first, "ok", fake_clock.now())
    [(job, adm)] = core.pump(fake_clock.now())
    assert job is third and adm.verdict == "admit" and adm.ticket.blocks == 10 and core.queue_length() == 0
    for j in (second, third):
        core.finish(j, "ok", fake_clock.now())
    assert core.in_flight(A) == 0
    core.check_integrity()


def test_scrape_usage_counts_and_unseen_blocks_are_added(fake_clock):
    core = make()
    held, _ = ask(core, fake_clock, 10)
    core.observe_load(A, ReplicaLoad(kv_cache_usage=0.70), fake_clock.now())  # 60 blocks of other traffic
    fake_clock.advance(0.1)
    late, adm = ask(core, fake_clock, 10)  # 0.70 + 0.10 = 0.80: admitted, not yet seen
    waiting, queued = ask(core, fake_clock, 10)  # 0.80 + 0.10 > 0.85
    assert adm.verdict == "admit" and queued.verdict == "queue"
    assert core.replica_view(A).kv_cache_usage == pytest.approx(0.80)
    core.observe_load(A, ReplicaLoad(kv_cache_usage=0.30), fake_clock.now())  # the replica freed room
    [(job, adm)] = core.pump(fake_clock.now())
    assert job is waiting and adm.ticket.new_blocks == 10


def test_idle_replica_admits_a_request_larger_than_the_watermark(fake_clock):
    core = make()
    _, adm = ask(core, fake_clock, 95)
    assert adm.verdict == "admit" and adm.ticket.blocks == 95


@pytest.mark.parametrize("admit_late", [False, True])
def test_wait_past_the_deadline_is_429_with_retry_after(fake_clock, admit_late):
    # with admit_late too: 80 running blocks leave no room for 10 under the watermark
    core = make(queue_timeout_s=0.05, admit_late=admit_late)
    held, _ = ask(core, fake_clock, 80)
    waiting, adm = ask(core, fake_clock, 10)
    assert adm.verdict == "queue"
    fake_clock.advance(0.1)
    [(job, adm)] = core.pump(fake_clock.now())
    assert job is waiting and adm.verdict == "reject" and adm.reason == "timeout" and adm.retry_after_s >= 1
    assert core.queue_length() == 0 and waiting.done


def test_with_admit_late_work_only_the_cache_keeping_rules_held_starts_at_its_timeout(fake_clock):
    # the session share holds s3 (live sessions s1, s2 at the 20-block size sessions end at);
    # the running work leaves room for it: at its timeout it starts (reason "late"), where the
    # 10 blocks behind 80 running ones (the watermark itself) are refused
    core = make(queue_timeout_s=5.0, session_fraction=0.5, admit_late=True)
    sessions_end_at_20_and_two_live(core, fake_clock)
    opener, adm = ask(core, fake_clock, 5, session="s3")
    assert (adm.verdict, adm.reason) == ("queue", "session_budget")
    fake_clock.advance(5.1)
    [(job, late)] = core.pump(fake_clock.now())
    assert job is opener and (late.verdict, late.reason) == ("admit", "late") and late.ticket.blocks == 5
    assert core.in_flight(A) == 1 and core.queue_length() == 0
    core.finish(opener, "ok", fake_clock.now())
    held, _ = ask(core, fake_clock, 80)
    waiting, adm = ask(core, fake_clock, 10)
    assert adm.verdict == "queue"
    fake_clock.advance(5.1)
    [(job, refused)] = core.pump(fake_clock.now())
    assert job is waiting and (refused.verdict, refused.reason) == ("reject", "timeout")
    core.check_integrity()


def test_full_queue_rejects_at_once(fake_clock):
    core = make(max_queue=1, max_queue_per_replica=0)
    ask(core, fake_clock, 80)
    _, queued = ask(core, fake_clock, 10)
    _, refused = ask(core, fake_clock, 10)
    assert queued.verdict == "queue" and (refused.verdict, refused.reason) == ("reject", "queue_full")


def test_continuing_session_goes_first_and_displaces_new_work(fake_clock):
    core = make(max_queue=1, max_queue_per_replica=0)
    turn1, _ = ask(core, fake_clock, 40, session="s1")
    core.finish(turn1, "ok", fake_clock.now())  # s1 is live now, its 40 blocks parked
    held, _ = ask(core, fake_clock, 40)
    new, adm = ask(core, fake_clock, 10)
    assert adm.verdict == "queue"
    turn2, adm2 = ask(core, fake_clock, 50, session="s1", prompt=tokens(50, turn1.spec.token_ids))
    assert adm2.verdict == "queue"  # continuing: pushes `new` out
    [(job, refused)] = core.pump(fake_clock.now())
    assert job is new and refused.reason == "displaced"
    core.finish(held, "ok", fake_clock.now())
    [(job, adm)] = core.pump(fake_clock.now())
    assert job is turn2 and adm.ticket.priority == "continuing_session"
    assert (adm.ticket.blocks, adm.ticket.new_blocks) == (50, 10)


def test_parked_sessions_hold_room_against_new_work_until_idle(fake_clock):
    # the mechanism, uncapped; the session share (two sessions of 40 blocks: 80 <= 85) apart
    core = make(queue_timeout_s=30.0, parked_fraction=1.0, session_fraction=1.0)
    for sid in ("s1", "s2"):
        job, _ = ask(core, fake_clock, 40, session=sid)
        core.finish(job, "ok", fake_clock.now())
    ask(core, fake_clock, 5)
    assert core.replica_view(A).kv_cache_usage == pytest.approx(0.85)
    new, adm = ask(core, fake_clock, 10, session="s3")
    assert adm.verdict == "queue"  # 0.85 + 0.10: the live sessions' prefixes would be evicted
    fake_clock.advance(11)  # both sessions idle past session_idle_s
    [(job, adm)] = core.pump(fake_clock.now())
    assert job is new and adm.ticket.blocks == 10


def test_group_members_after_the_first_are_group_priority(fake_clock):
    core = make()
    prompt = tokens(11)[:32 * 10 + 16]  # 10 full blocks + a partial one: 11 blocks at its peak
    first, a1 = ask(core, fake_clock, 11, group="g", prompt=prompt)
    second, a2 = ask(core, fake_clock, 11, group="g", prompt=prompt)  # shares the first member's 10 blocks
    assert (a1.ticket.priority, a2.ticket.priority) == ("new", "group_member")
    assert (a1.ticket.blocks, a2.ticket.blocks) == (11, 1) and core.admission.ledger.committed(A) == 12


def test_disabled_admits_everything(fake_clock):
    core = make(enabled=False)
    jobs = [ask(core, fake_clock, 60)[0] for _ in range(3)]
    assert core.admission.ledger.committed(A) == 180 and core.queue_length() == 0
    for j in jobs:
        core.finish(j, "ok", fake_clock.now())
    assert core.admission.ledger.committed(A) == 0


def test_cancelled_waiter_leaves_at_once_and_unhealthy_replica_sends_its_queue_back(fake_clock):
    core = make()
    held, _ = ask(core, fake_clock, 80)
    gone, _ = ask(core, fake_clock, 10)
    rerouted, _ = ask(core, fake_clock, 10)
    core.finish(gone, "cancelled", fake_clock.now())
    assert core.queue_length() == 1  # at once, not at its deadline
    core.set_health(A, False)
    [(job, adm)] = core.pump(fake_clock.now())
    assert job is rerouted and adm.verdict == "replica_gone" and job.decision is None and job.tried == [A]
    core.finish(held, "ok", fake_clock.now())
    core.finish(rerouted, "cancelled", fake_clock.now())
    assert core.in_flight(A) == 0 and core.queue_length() == 0
    core.check_integrity()


def test_a_cancelled_big_request_no_longer_holds_back_a_small_one(fake_clock):
    """Issue 9 defect: a 5-block request that fits waited 30 s behind a cancelled 60-block one."""
    core = make(queue_timeout_s=30.0)
    ask(core, fake_clock, 40)
    big, adm = ask(core, fake_clock, 60)
    assert adm.verdict == "queue"
    core.finish(big, "cancelled", fake_clock.now())
    small, adm = ask(core, fake_clock, 5)
    assert adm.verdict == "admit"


def test_a_stopping_router_refuses_every_queued_job_at_once(fake_clock):
    core = make()
    held, _ = ask(core, fake_clock, 80)
    queued = [ask(core, fake_clock, 10)[0] for _ in range(3)]
    core.refuse_queued("shutdown", fake_clock.now())
    refused = core.pump(fake_clock.now())
    assert [j for j, _ in refused] == queued and {a.reason for _, a in refused} == {"shutdown"}
    assert core.queue_length() == 0 and all(j.done for j in queued)
    core.finish(held, "ok", fake_clock.now())
    core.check_integrity()


def test_parked_prefixes_count_up_to_their_fraction_of_the_watermark_oldest_out_first(fake_clock):
    # 0.5 * 0.85 * 100 = 42 blocks; the session share apart (sessions of 40 blocks: two fit in 85)
    core = make(queue_timeout_s=30.0, parked_fraction=0.5, session_fraction=1.0)
    for sid in ("s1", "s2"):
        job, _ = ask(core, fake_clock, 40, session=sid)
        core.finish(job, "ok", fake_clock.now())
    assert core.registry.parked_blocks(A) == 40  # s1 (parked first) stopped counting
    assert (core.registry.parked_of("s1", A), core.registry.parked_of("s2", A)) == (0, 40)
    held, _ = ask(core, fake_clock, 5)
    new, adm = ask(core, fake_clock, 40, session="s3")
    assert adm.verdict == "admit"  # 40 parked + 5 + 40 <= 85: running work keeps its share
    core.check_integrity()


def test_a_group_waits_behind_its_queued_first_member(fake_clock):
    core = make()
    held, _ = ask(core, fake_clock, 80)
    prompt = tokens(11)[:32 * 10 + 16]
    first, a1 = ask(core, fake_clock, 11, group="g", prompt=prompt)
    second, a2 = ask(core, fake_clock, 11, group="g", prompt=prompt)  # would fit: 80 + 1 <= 85
    assert (a1.verdict, a2.verdict, a2.reason) == ("queue", "queue", "queued_behind")
    core.finish(held, "ok", fake_clock.now())
    assert [job for job, _ in core.pump(fake_clock.now())] == [first, second]  # one pump: prefilled once


def test_group_members_join_their_running_group_whatever_the_watermark(fake_clock):
    core = make()
    prompt = tokens(41)[:32 * 40 + 16]  # 40 full blocks + a partial one: 41 at its peak
    first, a1 = ask(core, fake_clock, 41, group="g", prompt=prompt)
    filler, _ = ask(core, fake_clock, 44)  # 41 + 44 = 85: at the watermark
    _, other = ask(core, fake_clock, 1)
    assert (a1.verdict, other.verdict) == ("admit", "queue")
    second, a2 = ask(core, fake_clock, 41, group="g", prompt=prompt)
    assert (a2.verdict, a2.reason, a2.ticket.blocks) == ("admit", "admitted", 1)  # shares the prompt
    _, a3 = ask(core, fake_clock, 41, group="h", prompt=prompt)
    assert a3.verdict == "queue"  # another group's first member waits for room
    core.finish(first, "ok", fake_clock.now())
    core.finish(second, "ok", fake_clock.now())
    assert not core.admission.ledger.group_running("g", A)
    core.check_integrity()


def test_a_group_admitted_after_waiting_counts_its_prompt_once(fake_clock):
    core = make()
    held, _ = ask(core, fake_clock, 80)
    prompt = tokens(11)[:32 * 10 + 16]  # 10 full blocks + a partial one: 11 at the peak
    members = [ask(core, fake_clock, 11, group="g", prompt=prompt)[0] for _ in range(4)]
    core.finish(held, "ok", fake_clock.now())
    admitted = core.pump(fake_clock.now())
    assert [job for job, _ in admitted] == members
    # the first brings the prompt; the rest hold only the block beyond it (placed while the first
    # waited, they found nothing cached and each reserved the whole prompt: 44 blocks, not 14)
    assert [adm.ticket.blocks for _, adm in admitted] == [11, 1, 1, 1]
    assert core.admission.ledger.committed(A) == 14
    core.check_integrity()


def park_session(core, clock, sid: str, blocks: int) -> list[int]:
    """Run one turn of ``sid`` of ``blocks`` blocks to completion; return its prompt."""
    prompt = tokens(blocks)
    job, adm = ask(core, clock, blocks, session=sid, prompt=prompt)
    assert adm.verdict == "admit"
    core.finish(job, "ok", clock.now())
    return prompt


def end_a_session_at_20(core, clock) -> None:
    """Session s0 runs a 10-block turn, then ends (``X-Session-End``) with a 20-block turn: the
    size sessions end at (``AdmissionState.session_blocks``) is 20 blocks."""
    prompt = park_session(core, clock, "s0", 10)
    last = core.open(RequestSpec(tokens(20, prompt), "s0", ends_session=True), clock.now())
    core.place(last, clock.now())
    core.admit(last, clock.now())
    core.finish(last, "ok", clock.now())


def sessions_end_at_20_and_two_live(core, clock, *live: str) -> None:
    """:func:`end_a_session_at_20`, then two sessions (``live``, default s1 and s2) each park a
    5-block turn: with session_fraction 0.5 (42.5 blocks) they fill the session share."""
    end_a_session_at_20(core, clock)
    for sid in live or ("s1", "s2"):
        park_session(core, clock, sid, 5)


def test_new_work_waits_rather_than_evict_a_parked_prefix_from_the_free_queue(fake_clock):
    # 100 blocks. s parks 10 (free-queue stamp 0); 40 blocks of other work run and finish
    # after it, so its deepest block has 50 free blocks queued behind it: it survives while
    # the work in flight holds at most 100 - 1 - 50 = 49 blocks (vLLM evicts the queue's head).
    core = make()
    prompt = park_session(core, fake_clock, "s", 10)
    other, _ = ask(core, fake_clock, 40)
    core.finish(other, "ok", fake_clock.now())
    small, _ = ask(core, fake_clock, 1)
    _, fits = ask(core, fake_clock, 48)  # 1 + 48 = 49: s survives
    _, evicts = ask(core, fake_clock, 1)  # 50 > 49: under the watermark, but it would evict s
    assert fits.verdict == "admit" and (evicts.verdict, evicts.reason) == ("queue", "parked_prefix")
    assert core.admission.queue.waiting()[0].priority == "new"
    # s's own next turn goes ahead (its prefix is in use from then on)
    turn, adm = ask(core, fake_clock, 12, session="s", prompt=tokens(12, prompt))
    assert adm.verdict == "admit"
    core.check_integrity()


def test_a_parked_prefix_past_saving_stops_holding_back_new_work(fake_clock):
    core = make()
    park_session(core, fake_clock, "s", 10)
    for _ in range(3):  # 90 blocks released after s: its deepest block is 100th from the tail
        job, _ = ask(core, fake_clock, 30)
        core.finish(job, "ok", fake_clock.now())
    assert core.registry.parked_of("s", A) == 10
    small, _ = ask(core, fake_clock, 1)
    _, adm = ask(core, fake_clock, 60)  # 1 + 10 + 60 <= 85: only the lost prefix stood in the way
    assert adm.verdict == "admit" and core.registry.parked_of("s", A) == 0
    core.check_integrity()


def test_a_hit_behind_a_parked_prefix_moves_it_toward_the_tail(fake_clock):
    # t parks after s; t's next turn takes t's 20 blocks out of the free queue: s's rank from
    # the tail drops by 20 (counted as allocation, s was declared lost while the engine held it)
    core = make()
    park_session(core, fake_clock, "s", 10)
    t_prompt = park_session(core, fake_clock, "t", 20)
    other, _ = ask(core, fake_clock, 30)
    core.finish(other, "ok", fake_clock.now())  # s: rank 60, t: rank 50
    t_turn, adm = ask(core, fake_clock, 22, session="t", prompt=tokens(22, t_prompt))
    assert adm.verdict == "admit"
    # in flight: t's 22 blocks; s's rank 60 - 20 = 40: new work may bring the peak to 59
    _, fits = ask(core, fake_clock, 37)
    assert fits.verdict == "admit" and core.registry.parked_of("s", A) == 10
    _, evicts = ask(core, fake_clock, 1)
    assert evicts.verdict == "queue"
    core.check_integrity()


def test_new_sessions_wait_while_live_sessions_fill_their_share_at_the_size_sessions_end_at(fake_clock):
    # 100 blocks: sessions may take 0.5 * 0.85 * 100 = 42.5. s0 ends at 20 blocks, so every
    # live session counts at least 20: two fit, a third waits, short-lived work does not.
    core = make(queue_timeout_s=30.0, session_fraction=0.5)
    end_a_session_at_20(core, fake_clock)
    assert core.admission.session_blocks == 20 and core.registry.parked_blocks(A) == 0
    park_session(core, fake_clock, "s1", 5)  # 0 + 20 <= 42.5
    park_session(core, fake_clock, "s2", 5)  # 20 + 20 <= 42.5
    third, adm = ask(core, fake_clock, 5, session="s3")  # 40 + 20 > 42.5
    assert (adm.verdict, adm.reason) == ("queue", "session_budget")
    # new work does not overtake it (FIFO within a class): the replica's churn slows while its
    # sessions' prefixes wait in the free queue (letting it pass: 4 replicas ws/kv 2, 1.52x ideal
    # prefilled vs 1.19x)
    other, queued = ask(core, fake_clock, 5)
    assert (queued.verdict, queued.reason) == ("queue", "queued_behind")
    assert core.pump(fake_clock.now()) == []
    core.end_session("s1")
    assert [job for job, _ in core.pump(fake_clock.now())] == [third, other]
    core.check_integrity()


def test_one_pump_pass_starts_only_the_sessions_the_share_holds(fake_clock):
    # 0.5 * 0.85 * 100 = 42.5 blocks for sessions, which end at 20: two live. s1 and s2 live,
    # s3, s4 and s5 wait; both live ones end: the pass admits two of the three, not all three
    # (asked once per replica per pass, a pass started every waiting session at once)
    core = make(queue_timeout_s=30.0, session_fraction=0.5)
    sessions_end_at_20_and_two_live(core, fake_clock)
    waiting = []
    for sid in ("s3", "s4", "s5"):
        job, adm = ask(core, fake_clock, 5, session=sid)
        assert adm.verdict == "queue" and adm.reason in ("session_budget", "queued_behind")
        waiting.append(job)
    core.end_session("s1")
    core.end_session("s2")
    started = [job for job, adm in core.pump(fake_clock.now()) if adm.verdict == "admit"]
    assert started == waiting[:2]
    assert core.queue_length() == 1
    core.check_integrity()


def test_a_new_session_goes_to_a_replica_with_session_room_rather_than_wait_on_a_full_one(fake_clock):
    # A's share is full (s1, s2 live); B, as loaded as A (nothing in flight) but sent more
    # requests, holds no session: the new session starts on B now instead of waiting on A,
    # which the tie-break alone would pick; a session that already has a pin stays on it
    b = ReplicaId("replica-1")
    core = make(queue_timeout_s=30.0, session_fraction=0.5)
    sessions_end_at_20_and_two_live(core, fake_clock)
    core.add_replica(b, block_size=32, num_gpu_blocks=100)
    core.policy.sent.set(b, 99, fake_clock.now())
    assert core.admission.sessions_full(core._view(A), fake_clock.now())
    job, adm = ask(core, fake_clock, 5, session="s3")
    assert (job.decision.replica_id, adm.verdict) == (b, "admit")
    core.finish(job, "ok", fake_clock.now())
    other, _ = ask(core, fake_clock, 5)  # no session: the share does not apply, requests sent do
    assert other.decision.replica_id == A
    core.finish(other, "ok", fake_clock.now())
    turn, adm = ask(core, fake_clock, 6, session="s1")
    assert (turn.decision.replica_id, adm.verdict) == (A, "admit")
    core.check_integrity()


def test_before_any_turn_finished_new_sessions_are_not_limited(fake_clock):
    core = make(queue_timeout_s=30.0, session_fraction=0.5)
    jobs = [ask(core, fake_clock, 15, session=sid) for sid in ("s1", "s2", "s3", "s4")]
    assert [adm.verdict for _, adm in jobs] == ["admit"] * 4  # 60 blocks <= 85: only the watermark
    assert core.admission.session_blocks is None and core.admission.largest_session_blocks == 0


def test_before_any_session_ended_sessions_count_at_the_largest_one_so_far(fake_clock):
    # 0.5 * 0.85 * 100 = 42.5 blocks for sessions; none has ended. s1's turns grow to 20 blocks:
    # s1 and s2 (5 blocks so far) each count 20, a third would bring 60 > 42.5, so s3 waits;
    # short-lived work does not count (a fleet's first minute: every session arriving started)
    core = make(queue_timeout_s=30.0, session_fraction=0.5)
    prompt = park_session(core, fake_clock, "s1", 10)
    turn, adm = ask(core, fake_clock, 20, session="s1", prompt=tokens(20, prompt))
    core.finish(turn, "ok", fake_clock.now())
    assert core.admission.session_blocks is None and core.admission.largest_session_blocks == 20
    park_session(core, fake_clock, "s2", 5)  # 20 + 20 <= 42.5
    other, free = ask(core, fake_clock, 30)  # no session: the share does not apply
    assert free.verdict == "admit"
    core.finish(other, "ok", fake_clock.now())
    third, adm = ask(core, fake_clock, 5, session="s3")  # 20 + 20 + 20 > 42.5
    assert (adm.verdict, adm.reason) == ("queue", "session_budget")
    core.end_session("s2")  # ended by DELETE, parked at 5 blocks: from now on sessions count at 5 (s1: 20)
    [(job, started)] = core.pump(fake_clock.now())
    assert job is third and started.verdict == "admit" and core.admission.session_blocks == 5
    core.check_integrity()


def test_sessions_parked_and_unseen_for_half_the_queue_timeout_leave_the_session_share(fake_clock):
    # abandoned sessions stay live until session_idle_s: the share must not turn their slots into 429s
    core = make(queue_timeout_s=30.0, session_idle_s=120.0, session_fraction=0.5)
    sessions_end_at_20_and_two_live(core, fake_clock, "gone1", "gone2")
    waiting, adm = ask(core, fake_clock, 5, session="s3")
    assert (adm.verdict, adm.reason) == ("queue", "session_budget")
    fake_clock.advance(14.9)
    assert core.pump(fake_clock.now()) == []
    fake_clock.advance(0.2)  # gone1 and gone2 unseen for 15.1 s: 0 + 20 <= 42.5
    [(job, adm)] = core.pump(fake_clock.now())
    assert job is waiting and adm.verdict == "admit"
    assert core.registry.parked_blocks(A) == 10  # still counted against the watermark
    core.check_integrity()


def test_without_admit_late_a_session_the_share_held_is_refused_at_its_timeout(fake_clock):
    core = make(queue_timeout_s=5.0, session_fraction=0.5)
    sessions_end_at_20_and_two_live(core, fake_clock)
    opener, adm = ask(core, fake_clock, 5, session="s3")
    assert (adm.verdict, adm.reason) == ("queue", "session_budget")
    fake_clock.advance(5.1)
    [(job, refused)] = core.pump(fake_clock.now())
    assert job is opener and (refused.verdict, refused.reason) == ("reject", "timeout")
    core.check_integrity()


def test_a_session_that_goes_idle_without_an_end_teaches_the_size_sessions_end_at(fake_clock):
    # s0 never says it ended: unseen for session_idle_s (10 s), its 20 parked blocks are the
    # sample. Then the share holds (0.5 * 0.85 * 100 = 42.5): s1, s2 live at 20 each, s3 waits.
    core = make(queue_timeout_s=30.0, session_idle_s=10.0, session_fraction=0.5)
    park_session(core, fake_clock, "s0", 20)
    assert core.admission.session_blocks is None
    fake_clock.advance(10.5)
    core.pump(fake_clock.now())
    assert core.admission.session_blocks == 20 and core.registry.parked_blocks(A) == 0
    park_session(core, fake_clock, "s1", 5)
    park_session(core, fake_clock, "s2", 5)
    _, adm = ask(core, fake_clock, 5, session="s3")
    assert (adm.verdict, adm.reason) == ("queue", "session_budget")
    core.check_integrity()


def test_a_replica_holding_no_session_always_starts_one(fake_clock):
    # one session's turn holds 70 of 100 blocks: counted at that size, a session could never fit
    # the share (0.75 * 0.85 * 100 = 63.75) anywhere, and none could ever start and teach a
    # smaller size (a fresh attacker's lockout). A replica holding no session takes one.
    b = ReplicaId("replica-1")
    core = make(queue_timeout_s=30.0, session_idle_s=10.0)
    core.add_replica(b, block_size=32, num_gpu_blocks=100)
    job = core.open(RequestSpec(tokens(60), "big", new_tokens=32 * 10), fake_clock.now())
    assert core.place(job, fake_clock.now(), only=A) is not None and core.admit(job, fake_clock.now()).verdict == "admit"
    core.finish(job, "ok", fake_clock.now())
    assert core.admission.largest_session_blocks == 70
    small, adm = ask(core, fake_clock, 2, session="small")
    assert (small.decision.replica_id, adm.verdict) == (b, "admit")  # B holds no session
    core.finish(small, "ok", fake_clock.now())
    fake_clock.advance(10.5)  # both idle: "big"'s 70 blocks become the size sessions end at
    core.pump(fake_clock.now())
    assert core.admission.session_blocks is not None and core.admission.session_blocks >= 70 * 0.9
    started = [ask(core, fake_clock, 2, session=f"s{i}")[1].verdict for i in range(2)]
    assert started == ["admit", "admit"]  # one per replica, each holding none
    core.check_integrity()


def test_a_session_ended_by_delete_while_its_last_turn_waits_is_one_sample_not_two(fake_clock):
    # s0 parks 10 blocks; its X-Session-End turn of 50 blocks waits behind 60 blocks of other work;
    # a DELETE ends s0 meanwhile (the sample: its parked 10 blocks). When the turn runs and ends,
    # that is the same session ending: no second sample (the average would read (10 + 50) / ...)
    core = make(queue_timeout_s=30.0)
    prompt = park_session(core, fake_clock, "s0", 10)
    busy, adm = ask(core, fake_clock, 60)
    assert adm.verdict == "admit"
    last = core.open(RequestSpec(tokens(50, prompt), "s0", ends_session=True), fake_clock.now())
    core.place(last, fake_clock.now())
    assert core.admit(last, fake_clock.now()).verdict == "queue"
    assert core.end_session("s0") and core.admission.session_blocks == 10
    core.finish(busy, "ok", fake_clock.now())
    [(job, started)] = core.pump(fake_clock.now())
    assert job is last and started.verdict == "admit"
    core.finish(last, "ok", fake_clock.now())
    assert core.admission.session_blocks == 10
    assert core.registry.record_of("session", "s0") is None  # ended, and nothing of it in flight
    core.check_integrity()


def test_a_placement_undone_is_not_counted_as_sent(fake_clock):
    # a request refused by A (4xx) or whose client left while it waited prefilled nothing there:
    # A's count of requests sent lately is back where it was, and the next new key is not steered
    # away from A by work A never did
    b = ReplicaId("replica-1")
    core = make(queue_timeout_s=30.0)
    core.add_replica(b, block_size=32, num_gpu_blocks=100)
    core.policy.sent.set(b, 1, fake_clock.now())
    refused, _ = ask(core, fake_clock, 5)
    assert refused.decision.replica_id == A and core.policy.sent.get(A, fake_clock.now()) == 1
    core.finish(refused, "refused", fake_clock.now())
    assert core.policy.sent.get(A, fake_clock.now()) == 0
    busy, _ = ask(core, fake_clock, 80)  # on A (0 sent), admitted
    waiting, adm = ask(core, fake_clock, 5)
    assert (busy.decision.replica_id, waiting.decision.replica_id) == (A, b)  # A 1 + load 1 > b 1 + 0
    core.finish(waiting, "cancelled", fake_clock.now())  # admitted on b: it ran there, stays counted
    assert core.policy.sent.get(b, fake_clock.now()) == 2
    core.check_integrity()


def test_a_deleted_session_whose_turn_is_placed_again_stays_ended(fake_clock):
    # s0 parks 10 blocks; its last turn (with or without X-Session-End) waits on A; DELETE ends s0;
    # a weight update sends the queued turn back (replica_gone) and the router places it again:
    # the session is not revived (no pin, nothing parked, no second sample) and its record goes
    # when the turn ends (a fresh attacker's case: placing a job revived an ended session)
    b = ReplicaId("replica-1")
    for ends in (True, False):
        core = make(queue_timeout_s=30.0)
        prompt = park_session(core, fake_clock, "s0", 10)
        busy, _ = ask(core, fake_clock, 60)
        core.add_replica(b, block_size=32, num_gpu_blocks=100)
        last = core.open(RequestSpec(tokens(50, prompt), "s0", ends_session=ends), fake_clock.now())
        core.place(last, fake_clock.now())
        assert core.admit(last, fake_clock.now()).verdict == "queue"
        assert core.end_session("s0") and core.admission.session_blocks == 10
        for rid in (A, b):
            core.set_rotation(rid, "updating")
            core.version_loaded(rid, 1)
            core.set_rotation(rid, None)
        core.finish_update(1, "keep+salt")
        [(job, gone)] = core.pump(fake_clock.now())
        assert job is last and gone.verdict == "replica_gone"
        core.finish(busy, "ok", fake_clock.now())
        core.place(last, fake_clock.now())
        assert core.admit(last, fake_clock.now()).verdict == "admit"
        core.finish(last, "ok", fake_clock.now())
        assert core.admission.session_blocks == 10
        assert core.registry.record_of("session", "s0") is None
        assert core.registry.parked_blocks(A) == core.registry.parked_blocks(b) == 0
        core.check_integrity()


def test_a_delete_while_the_last_turn_runs_samples_that_turn_once(fake_clock):
    # the turn was admitted (its prefix no longer parked), then DELETE: the end has nothing to
    # sample, so the turn's release does, once (before, with X-Session-End, no sample was taken)
    for ends in (True, False):
        core = make(queue_timeout_s=30.0)
        prompt = park_session(core, fake_clock, "s0", 10)
        last = core.open(RequestSpec(tokens(50, prompt), "s0", ends_session=ends), fake_clock.now())
        core.place(last, fake_clock.now())
        assert core.admit(last, fake_clock.now()).verdict == "admit"
        assert core.end_session("s0") and core.admission.session_blocks is None
        core.finish(last, "ok", fake_clock.now())
        assert core.admission.session_blocks == 50 and core.registry.record_of("session", "s0") is None
        # the id used again after the end: a new session, pinned and parked as any other
        park_session(core, fake_clock, "s0", 5)
        assert core.registry.get("session", "s0").replica == A and core.registry.parked_blocks(A) == 5
        core.check_integrity()


def test_an_attempt_undone_after_its_replica_came_back_leaves_the_new_ones_count_alone(fake_clock):
    # placed on A, A leaves and comes back under its id (levelled with B), then the old attempt
    # fails (unreachable): the undo is the old incarnation's, not the new one's (it would sit below
    # the level and draw new keys: a fresh attacker's case)
    b = ReplicaId("replica-1")
    core = make()
    core.add_replica(b, block_size=32, num_gpu_blocks=100)
    core.policy.sent.set(b, 1, fake_clock.now())
    job, _ = ask(core, fake_clock, 5)
    assert job.replica_id == A
    core.remove_replica(A, fake_clock.now())
    core.add_replica(A, block_size=32, num_gpu_blocks=100)
    before = {rid: core.policy.sent.get(rid, fake_clock.now()) for rid in (A, b)}
    assert before == {A: 1, b: 1}
    core.finish(job, "unreachable", fake_clock.now())
    assert {rid: core.policy.sent.get(rid, fake_clock.now()) for rid in (A, b)} == before
    core.check_integrity()


def test_a_removed_replica_leaves_no_ledger_entry_once_its_last_ticket_is_released():
    """A fleet that changes for days must not keep counts per replica it ever had (NOTES D12)."""
    from cache_policy.ledger import KvLedger, Ticket

    ledger = KvLedger()
    gone, stays, idle = ReplicaId("replica-7"), ReplicaId("replica-8"), ReplicaId("replica-9")
    tickets = [Ticket(rid, 3, 3, None, 1.0, "new", n) for n, rid in enumerate((gone, gone, stays, idle))]
    for t in tickets:
        ledger.admit(t)
    ledger.scraped(gone, 0.5)
    ledger.release(tickets[3])
    ledger.forget_replica(idle)  # nothing in flight: its entries go at once
    ledger.forget_replica(gone)  # two tickets out: counted until they are released
    assert ledger.count(gone) == 2 and idle not in ledger.requests_by_replica
    ledger.release(tickets[0])
    assert ledger.count(gone) == 1 and ledger.committed(gone) == 3
    ledger.release(tickets[1])
    ledger.check_integrity()
    assert dict(ledger.requests_by_replica) == {stays: 1} and ledger.committed(gone) == 0
    assert gone not in ledger.scraped_at and ledger.unseen(gone) == 0


def _queued_behind_a_full_replica(core, clock):
    """A holds 80 of 100 blocks; four requests queue there: a new prompt, a new session's first
    turn (10 blocks each), a prompt extending the running one's (cached on A, 90 blocks) and a
    new GRPO group's first member (10 blocks)."""
    held, _ = ask(core, clock, 80)
    plain, a1 = ask(core, clock, 10)
    session, a2 = ask(core, clock, 10, session="s-new")
    cached, a3 = ask(core, clock, 90, prompt=tokens(90, held.spec.token_ids[:32 * 80]))
    member, a4 = ask(core, clock, 10, group="g")
    assert [a.verdict for a in (a1, a2, a3, a4)] == ["queue"] * 4
    assert cached.decision.matched_blocks == 80 and plain.decision.matched_blocks == 0
    return held, plain, session, cached, member


@pytest.mark.parametrize("blocks, moved", [(100, 3), (20, 1)])
def test_a_replica_that_joins_takes_queued_work_that_loses_nothing_by_moving(fake_clock, blocks, moved):
    # before: a replica added while requests queued got none of them; they waited on the full one
    core = make(queue_timeout_s=30.0)
    held, plain, session, cached, member = _queued_behind_a_full_replica(core, fake_clock)
    b = ReplicaId("replica-1")
    core.add_replica(b, block_size=32, num_gpu_blocks=blocks)
    back = core.pump(fake_clock.now())
    # in service order while they fit b's watermark (0.85 * 20 = 17 blocks: the first alone, as
    # an idle replica always admits one); the prompt cached on A stays there
    assert [j for j, _ in back] == [plain, session, member][:moved]
    for job, adm in back:
        assert adm.verdict == "replica_gone" and job.move_to == b and job.decision is None and job.tried == []
        assert core.place(job, fake_clock.now()).replica_id == b
        assert core.admit(job, fake_clock.now()).verdict == "admit"
    assert str(cached.id) in {r.request_id for r in core.admission.queue.waiting()}
    assert core.pump(fake_clock.now()) == []  # nothing more fits while they run
    if moved == 1:  # the session's turn moves once the first request ends there
        core.finish(plain, "ok", fake_clock.now())
        [(job, adm)] = core.pump(fake_clock.now())
        assert job is session and adm.verdict == "replica_gone" and job.move_to == b
        assert core.place(job, fake_clock.now()).replica_id == b and core.admit(job, fake_clock.now()).verdict == "admit"
    assert core.registry.get("session", "s-new").replica == b  # its pin follows it
    core.check_integrity()


def test_the_offer_ends_once_the_joined_replica_queues_work_of_its_own(fake_clock):
    core = make(queue_timeout_s=30.0)
    b = ReplicaId("replica-1")
    _queued_behind_a_full_replica(core, fake_clock)
    core.add_replica(b, block_size=32, num_gpu_blocks=20)
    [(first, _)] = core.pump(fake_clock.now())
    core.place(first, fake_clock.now())
    core.admit(first, fake_clock.now())
    own = core.open(RequestSpec(tokens(10)), fake_clock.now())
    assert core.place(own, fake_clock.now(), only=b) is not None and core.admit(own, fake_clock.now()).verdict == "queue"
    core.finish(first, "ok", fake_clock.now())
    assert [j for j, adm in core.pump(fake_clock.now())] == [own]  # b's own queued request, not A's
    assert b not in core._joined


def test_a_joining_replica_of_unknown_size_is_offered_work_after_its_first_scrape(fake_clock):
    core = make(queue_timeout_s=30.0)
    _, plain, session, _, _ = _queued_behind_a_full_replica(core, fake_clock)
    b = ReplicaId("replica-1")
    core.add_replica(b, block_size=32)
    assert core.pump(fake_clock.now()) == []  # no size known: it could be sent everything
    core.observe_load(b, ReplicaLoad(num_gpu_blocks=100), fake_clock.now())
    assert [j for j, _ in core.pump(fake_clock.now())][:2] == [plain, session]


def test_a_replica_back_in_service_is_not_offered_queued_work(fake_clock):
    # healthy again, or back in rotation after a weight update: its own queue went elsewhere when
    # it left, and new placements reach it by load; moving others' queued work there too read no
    # gain in bench.sim and a longer GRPO group tail (DecisionCore._offer_joined)
    core = make(queue_timeout_s=30.0)
    b = ReplicaId("replica-1")
    core.add_replica(b, block_size=32, num_gpu_blocks=100)
    core.set_health(b, False)
    assert core.pump(fake_clock.now()) == []
    _queued_behind_a_full_replica(core, fake_clock)
    core.set_health(b, True)
    assert core.pump(fake_clock.now()) == []
    core.set_rotation(b, "updating")
    core.set_rotation(b, None)
    assert core.pump(fake_clock.now()) == [] and core.queue_length() == 4


def test_a_joining_replica_takes_new_sessions_only_within_its_session_share(fake_clock):
    # sessions end at 20 blocks here: b (100 blocks, share 0.75 * 0.85 * 100 = 63.75) starts three
    # (40 held + one more 20 = 60 fits; 60 + 20 = 80 does not); a plain request behind them moves too
    core = make(queue_timeout_s=30.0)
    end_a_session_at_20(core, fake_clock)
    ask(core, fake_clock, 82)
    sessions = [ask(core, fake_clock, 5, session=f"new-{i}")[0] for i in range(4)]
    plain, adm = ask(core, fake_clock, 5)
    assert adm.verdict == "queue" and all(j.queued is not None for j in sessions)
    b = ReplicaId("replica-1")
    core.add_replica(b, block_size=32, num_gpu_blocks=100)
    moved = [j for j, _ in core.pump(fake_clock.now())]
    assert moved == [*sessions[:3], plain], [j.spec.session_id for j in moved]


def test_a_queued_grpo_group_moves_whole_or_not_at_all(fake_clock):
    # a new group's first member and two more queue on A (nothing of it is cached or runs there):
    # they move together, first member first, counted at one prompt plus each member's own blocks
    # (10 + 1 + 1 = 12): beside 4 blocks running on b, 16 fit 0.85 * 20 = 17 and not 0.85 * 18 = 15.3
    b = ReplicaId("replica-1")
    for blocks, fits in ((18, False), (20, True)):
        core = make(queue_timeout_s=30.0)
        ask(core, fake_clock, 82)
        prompt = tokens(10)[:32 * 10 - 16]  # 9.5 blocks: with 16 new tokens each member peaks at 10
        members = [core.open(RequestSpec(prompt, None, "g", new_tokens=16), fake_clock.now()) for _ in range(3)]
        for job in members:
            core.place(job, fake_clock.now())
            assert core.admit(job, fake_clock.now()).verdict == "queue"
        core.add_replica(b, block_size=32, num_gpu_blocks=blocks)
        busy = core.open(RequestSpec(tokens(4)), fake_clock.now())
        core.place(busy, fake_clock.now(), only=b)
        assert core.admit(busy, fake_clock.now()).verdict == "admit"
        back = core.pump(fake_clock.now())
        if not fits:  # the first member alone would fit: the group stays whole on A
            assert back == [] and core.queue_length() == 3
            continue
        assert [j for j, _ in back] == members and all(j.move_to == b for j in members)
        for job in members:
            assert core.place(job, fake_clock.now()).replica_id == b
            assert core.admit(job, fake_clock.now()).verdict == "admit"
        assert core.registry.get("group", "g").replica == b
        core.check_integrity()
