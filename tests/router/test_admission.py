"""AdmissionController on the event loop: admit, wait, wake, 429s, parked sessions (no vLLM)."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from cache_policy.config import PolicyConfig
from cache_policy.types import ReplicaId
from replicas.metrics import VllmMetrics
from replicas.replica_set import ReplicaEndpoint
from router.admission import AdmissionController, ReplicaGone
from router.errors import Overloaded
from router.pool import ReplicaPool

pytestmark = pytest.mark.asyncio(loop_scope="function")
A = ReplicaId("replica-0")


def make(fake_clock, blocks: int = 100, enabled: bool = True, **policy) -> AdmissionController:
    pool = ReplicaPool([ReplicaEndpoint(A, "http://127.0.0.1:9", 32, blocks, "m")])
    cfg = PolicyConfig(**{"queue_timeout_s": 5.0, "session_idle_s": 10.0, **policy})
    return AdmissionController(cfg, pool, CollectorRegistry(), enabled=enabled, clock=fake_clock.now)


def scrape(ctl: AdmissionController, fake_clock, usage: float) -> None:
    ctl.pool.get(A).metrics = VllmMetrics(kv_cache_usage=usage)
    ctl.on_scrape(fake_clock.now())


async def test_admits_under_the_watermark_and_queues_above(fake_clock):
    ctl = make(fake_clock)
    first = await ctl.acquire(A, 50, 0, None, None)
    second = await ctl.acquire(A, 30, 0, None, None)  # 0.8 <= 0.85
    waiting = asyncio.ensure_future(ctl.acquire(A, 10, 0, None, None))  # 0.9 > 0.85
    await asyncio.sleep(0)
    assert not waiting.done() and len(ctl.queue) == 1
    ctl.release(first)
    third = await asyncio.wait_for(waiting, 1)
    assert third.blocks == 10 and len(ctl.queue) == 0
    for t in (second, third):
        ctl.release(t)
    ctl.check_integrity()


async def test_scrape_usage_counts_and_unseen_blocks_are_added(fake_clock):
    ctl = make(fake_clock)
    held = await ctl.acquire(A, 10, 0, None, None)
    scrape(ctl, fake_clock, 0.70)  # other traffic holds 60 blocks more than the ledger says
    fake_clock.advance(0.1)
    late = await ctl.acquire(A, 10, 0, None, None)  # 0.70 + 0.10 = 0.80: admitted, not yet seen
    waiting = asyncio.ensure_future(ctl.acquire(A, 10, 0, None, None))  # 0.80 + 0.10 > 0.85
    await asyncio.sleep(0)
    assert not waiting.done()
    assert ctl.projected_usage(A) == pytest.approx(0.80)
    scrape(ctl, fake_clock, 0.30)  # the replica freed room
    assert (await asyncio.wait_for(waiting, 1)).new_blocks == 10
    for t in (held, late):
        ctl.release(t)


async def test_idle_replica_admits_a_request_larger_than_the_watermark(fake_clock):
    ctl = make(fake_clock)
    ticket = await ctl.acquire(A, 95, 0, None, None)
    assert ticket.blocks == 95


async def test_wait_past_the_deadline_is_429_with_retry_after(fake_clock):
    ctl = make(fake_clock, queue_timeout_s=0.05)
    held = await ctl.acquire(A, 80, 0, None, None)
    waiting = asyncio.ensure_future(ctl.acquire(A, 10, 0, None, None))
    await asyncio.sleep(0)
    fake_clock.advance(0.1)
    with pytest.raises(Overloaded) as err:
        await asyncio.wait_for(waiting, 2)
    assert err.value.status == 429 and int(err.value.headers["Retry-After"]) >= 1
    assert len(ctl.queue) == 0
    ctl.release(held)


async def test_full_queue_rejects_at_once(fake_clock):
    ctl = make(fake_clock, max_queue=1)
    held = await ctl.acquire(A, 80, 0, None, None)
    waiting = asyncio.ensure_future(ctl.acquire(A, 10, 0, None, None))
    await asyncio.sleep(0)
    with pytest.raises(Overloaded, match="queue full"):
        await ctl.acquire(A, 10, 0, None, None)
    waiting.cancel()
    ctl.release(held)


async def test_continuing_session_goes_first_and_displaces_new_work(fake_clock):
    ctl = make(fake_clock, max_queue=1)
    turn1 = await ctl.acquire(A, 40, 0, "s1", None)
    ctl.release(turn1)  # s1 is live now, its 40 blocks parked
    held = await ctl.acquire(A, 40, 0, None, None)
    new = asyncio.ensure_future(ctl.acquire(A, 10, 0, None, None))
    await asyncio.sleep(0)
    turn2 = asyncio.ensure_future(ctl.acquire(A, 50, 40, "s1", None))  # continuing: pushes `new` out
    with pytest.raises(Overloaded, match="pushed out"):
        await asyncio.wait_for(new, 1)
    ctl.release(held)
    ticket = await asyncio.wait_for(turn2, 1)
    assert ticket.priority == "continuing_session" and (ticket.blocks, ticket.new_blocks) == (50, 10)


async def test_parked_sessions_hold_room_against_new_work_until_idle(fake_clock):
    ctl = make(fake_clock, queue_timeout_s=30.0)
    for sid in ("s1", "s2"):
        ctl.release(await ctl.acquire(A, 40, 0, sid, None))
    busy = await ctl.acquire(A, 5, 0, None, None)
    assert ctl.projected_usage(A) == pytest.approx(0.85)
    new = asyncio.ensure_future(ctl.acquire(A, 10, 0, "s3", None))
    await asyncio.sleep(0)
    assert not new.done()  # 0.85 + 0.10: the live sessions' prefixes would be evicted
    fake_clock.advance(11)  # both sessions idle past session_idle_s
    ctl.pump()
    assert (await asyncio.wait_for(new, 1)).blocks == 10
    ctl.release(busy)


async def test_group_members_after_the_first_are_group_priority(fake_clock):
    ctl = make(fake_clock)
    first = await ctl.acquire(A, 11, 0, None, "g")
    second = await ctl.acquire(A, 11, 10, None, "g")  # shares the first member's 10 prompt blocks
    assert (first.priority, second.priority) == ("new", "group_member")
    assert (first.blocks, second.blocks) == (11, 1) and ctl.ledger.committed(A) == 12


async def test_disabled_admits_everything(fake_clock):
    ctl = make(fake_clock, enabled=False)
    tickets = [await ctl.acquire(A, 60, 0, None, None) for _ in range(3)]
    assert ctl.ledger.committed(A) == 180 and len(ctl.queue) == 0
    for t in tickets:
        ctl.release(t)
    assert ctl.ledger.committed(A) == 0


async def test_cancelled_waiter_is_skipped_and_unhealthy_replica_drops_its_queue(fake_clock):
    ctl = make(fake_clock)
    held = await ctl.acquire(A, 80, 0, None, None)
    gone = asyncio.ensure_future(ctl.acquire(A, 10, 0, None, None))
    rerouted = asyncio.ensure_future(ctl.acquire(A, 10, 0, None, None))
    await asyncio.sleep(0)
    gone.cancel()
    await asyncio.sleep(0)
    ctl.pool.get(A).healthy = False
    ctl.on_scrape(fake_clock.now())
    with pytest.raises(ReplicaGone):
        await asyncio.wait_for(rerouted, 1)
    ctl.release(held)
    assert ctl.ledger.count(A) == 0 and len(ctl.queue) == 0
