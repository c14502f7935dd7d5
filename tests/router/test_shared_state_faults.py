"""router.state when Redis fails: deadlines, the breaker, restart empty, start while down.

Real redis-server processes owned by each test (SIGKILL, SIGSTOP/SIGCONT, restart on one port).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from cache_policy.core import RequestSpec
from cache_policy.salts import cache_salt_for_version
from router.state.redis_client import Breaker, StateUnavailable
from tests.conftest import FakeClock
from tests.router.ha_redis import RedisProcess, free_port
from tests.router.test_shared_state import R0, R1, Router

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_the_breaker_opens_after_its_failures_probes_once_and_closes_on_success():
    clock = FakeClock()
    b = Breaker(3, 1.0, clock.now)
    assert [b.failure() for _ in range(3)] == [False, False, True] and b.state == "open" and not b.allow()
    clock.advance(1.0)
    assert b.allow() and not b.allow()  # one probe at a time
    assert b.failure() is False and b.state == "open"  # a failed probe re-opens it
    clock.advance(1.0)
    assert b.allow() and b.success() is True and b.state == "closed" and b.allow()
    assert b.opened == 1


async def test_a_hung_redis_costs_a_call_its_deadline_then_nothing_and_it_recovers(tmp_path):
    redis = RedisProcess(tmp_path).start()
    try:
        r = Router(redis.url, "f1:", timeout_s=0.1)
        r.state.redis.breaker.reset_s = 0.5
        await r.route(RequestSpec(list(range(64)), session_id="s"))
        redis.stop()
        took = []
        for _ in range(6):
            started = time.monotonic()
            job = await r.route(RequestSpec(list(range(64)), session_id="s"))
            took.append(time.monotonic() - started)
            assert job.replica_id is not None
        assert max(took[:3]) < 2 * 0.1 + 0.05  # the read's and the claim's deadlines (redis_timeout_s = 0.1)
        assert max(took[3:]) < 0.01 and r.state.redis.breaker.state == "open"  # fails fast, no network
        assert max(r.state.redis.waited_s) < 0.1 + 0.03  # no call outlived its deadline
        redis.cont()
        await asyncio.sleep(0.55)
        await r.route(RequestSpec(list(range(64)), session_id="s"))
        assert r.state.available and r.state._reconcile  # back: the next sync round reconciles
    finally:
        redis.close()


async def test_pins_placed_while_redis_was_down_are_claimed_when_it_is_back(tmp_path):
    redis = RedisProcess(tmp_path).start()
    try:
        a, b = Router(redis.url, "f2:", timeout_s=0.1), Router(redis.url, "f2:", timeout_s=0.1)
        redis.stop()
        during = await a.route(RequestSpec(list(range(64)), session_id="during"))
        assert ("session", "during") in a.state.pins.dirty
        redis.cont()
        await asyncio.sleep(1.05)
        await a.state.sync_round()
        assert not a.state.pins.dirty
        later = await b.route(RequestSpec(list(range(96)), session_id="during"), 1.0)
        assert later.replica_id == during.replica_id and later.decision.reason.value == "session"
    finally:
        redis.close()


async def test_redis_restarted_empty_gets_pins_versions_and_registry_back(tmp_path):
    redis = RedisProcess(tmp_path).start()
    try:
        a = Router(redis.url, "f3:", timeout_s=0.1)
        await a.state.start(a.app, a.core)
        job = await a.route(RequestSpec(list(range(64)), group_id="g"))
        a.core.version_loaded(R0, 2)
        a.core.version_loaded(R1, 2)
        a.core.finish_update(2, "salt")
        assert await a.state.publish_versions(a.core)
        epoch = a.state.versions.applied
        redis.kill()
        redis.start()  # same port, no data
        await asyncio.sleep(1.05)  # the breaker's reset
        for _ in range(3):
            await a.state.sync_round()
        client = a.state.redis.client
        assert await client.get("f3:pin:group:g") == f"{job.replica_id}|0"
        assert int(await client.get("f3:versions:epoch")) == epoch
        assert sorted(await client.hkeys("f3:replicas")) == [R0, R1]
        assert a.state.restarts_seen == 1
        b = Router(redis.url, "f3:")
        new = await b.route(RequestSpec(list(range(64)), session_id="new"))
        assert new.salt == cache_salt_for_version(2) and b.core.versions.policy == "salt"
    finally:
        redis.close()


async def test_a_router_started_while_redis_is_down_serves_unsalted_then_joins(tmp_path):
    port = free_port()
    r = Router(f"redis://127.0.0.1:{port}/0", "f4:", timeout_s=0.1)
    r.state.redis.breaker.reset_s = 0.2
    started = time.monotonic()
    await r.state.start(r.app, r.core)
    assert time.monotonic() - started < 0.5 and not r.state.versions.confirmed
    job = await r.route(RequestSpec(list(range(64)), session_id="early"))
    assert job.salt is None and job.replica_id is not None  # no guessed salt
    redis = RedisProcess(tmp_path, port).start()
    try:
        await asyncio.sleep(0.25)
        for _ in range(2):
            await r.state.sync_round()
        assert r.state.versions.confirmed and r.core.versions.current == 0
        client = r.state.redis.client
        assert await client.zscore("f4:routers", r.state.router_id) is not None
        assert (await client.get("f4:pin:session:early")).startswith(job.replica_id + "|")
        assert r.core.open(RequestSpec(list(range(64))), 1.0).salt == cache_salt_for_version(0)
    finally:
        redis.close()


async def test_every_call_fails_as_state_unavailable_not_as_a_redis_error(tmp_path):
    r = Router(f"redis://127.0.0.1:{free_port()}/0", "f5:", timeout_s=0.1)
    with pytest.raises(StateUnavailable):
        await r.state.redis.call(lambda c: c.get("x"))
    assert not await r.state.acquire_update_lock("o", 5) and not await r.state.publish_versions(r.core)
    await r.state.release_update_lock("o")  # never raises


async def test_a_newer_version_epoch_that_cannot_be_read_stops_salting_until_it_can(tmp_path):
    redis = RedisProcess(tmp_path).start()
    try:
        a, b = Router(redis.url, "f6:"), Router(redis.url, "f6:")
        assert (await b.route(RequestSpec(list(range(64))))).salt == cache_salt_for_version(0)
        client = a.state.redis.client
        await client.set("f6:versions:epoch", 5)
        await client.set("f6:versions", "not a hash")  # HGETALL fails: WRONGTYPE
        stale = await b.route(RequestSpec(list(range(64))), 1.0)
        assert stale.salt is None and not b.state.versions.confirmed  # its view is known stale: no guess
        await client.delete("f6:versions", "f6:versions:epoch")
        a.core.version_loaded(R0, 6)
        a.core.version_loaded(R1, 6)
        a.core.finish_update(6, "salt")
        assert await a.state.publish_versions(a.core)
        fresh = await b.route(RequestSpec(list(range(64))), 2.0)
        assert fresh.salt == cache_salt_for_version(6) and b.state.versions.confirmed
    finally:
        redis.close()


def _update(core, rid, version: int, policy: str = "keep+salt") -> None:
    """One replica's update as ``router.weights.steps`` makes it: held, loaded, back in rotation."""
    core.set_rotation(rid, "updating")
    core.version_loaded(rid, version)
    core.set_rotation(rid, None)
    core.finish_update(version, policy)


async def _rounds(*routers, n: int = 3) -> None:
    for _ in range(n):
        for r in routers:
            await r.state.sync_round()


async def test_after_redis_is_flushed_the_updater_keeps_its_own_versions_and_the_next_epoch_reaches_everyone(tmp_path):
    """Redis loses its data (FLUSHALL) after updates published by one router: that router must
    not fall back to an older snapshot (it used to re-apply the last one it had *fetched*, with
    replicas mid-update: out of rotation on it for good), and the next update's epoch must pass
    what every router applied (the counter restarted at 1 and routers at epoch 25 ignored it)."""
    redis = RedisProcess(tmp_path).start()
    try:
        a, b = await _started_pair(redis.url, "f7:")
        for version in (1, 2, 3):
            for rid in (R0, R1):
                a.core.set_rotation(rid, "updating")
                assert await a.state.publish_versions(a.core)  # the hold, as steps.hold publishes it
                # a's own pub/sub echo can win the race with the publication's answer: it fetches
                # the hold it wrote (what its view must not fall back to later)
                a.state.versions.applied -= 1
                await a.state.versions.fetch(a.core)
                await b.state.sync_round()
                a.core.version_loaded(rid, version)
                a.core.set_rotation(rid, None)
                a.core.finish_update(version, "keep+salt")
                assert await a.state.publish_versions(a.core)
        await _rounds(a, b)
        applied = b.state.versions.applied
        assert b.core.versions.loaded == {R0: 3, R1: 3} and not b.core.versions.rotation
        await a.state.redis.client.flushall()
        await _rounds(a, b)
        a.state.versions.reapply(a.core)  # as when the registry brings a replica another router added
        for r in (a, b):
            assert r.core.versions.loaded == {R0: 3, R1: 3} and not r.core.versions.rotation, r.core.versions.rotation
        _update(a.core, R0, 4)
        _update(a.core, R1, 4)
        assert await a.state.publish_versions(a.core) and a.state.versions.applied > applied
        await _rounds(b)
        assert b.core.versions.loaded == {R0: 4, R1: 4} and b.core.versions.current == 4
        job = await b.route(RequestSpec(list(range(64))), 1.0)
        assert job.salt == cache_salt_for_version(4)
        await a.state.redis.client.flushall()  # and an update right after, before any sync round
        _update(a.core, R0, 5)
        _update(a.core, R1, 5)
        assert await a.state.publish_versions(a.core) and a.state.versions.applied > b.state.versions.applied
        job = await b.route(RequestSpec(list(range(64))), 2.0)
        assert job.salt == cache_salt_for_version(5) and b.core.versions.loaded == {R0: 5, R1: 5}
    finally:
        redis.close()


async def test_a_hold_whose_answer_was_lost_is_taken_back_on_every_router(tmp_path):
    """A publication Redis ran but whose answer came too late (SIGSTOPped Redis): the updater
    counts the hold as failed and puts the replica back; the other routers, which read the hold
    from Redis, must see it back too (they kept it out of rotation with no update running)."""
    redis = RedisProcess(tmp_path).start()
    try:
        a, b = await _started_pair(redis.url, "f8:", tight_a=True)
        a.core.set_rotation(R1, "updating")
        redis.stop()
        assert not await a.state.publish_versions(a.core)  # no answer within 0.1 s
        a.core.set_rotation(R1, None)  # steps.hold: the update does not go ahead
        assert not await a.state.publish_versions(a.core)
        redis.cont()
        await asyncio.sleep(0.3)
        await b.state.sync_round()
        assert b.state.versions.applied >= 1  # the hold was written all the same: b read it
        await _rounds(a, b)
        for r in (a, b):
            assert not r.core.versions.rotation, r.core.versions.rotation
        assert not a.state.versions.pending
    finally:
        redis.close()


async def test_a_publication_sent_again_never_overwrites_a_newer_one_of_another_router(tmp_path):
    redis = RedisProcess(tmp_path).start()
    try:
        a, b = await _started_pair(redis.url, "f9:")
        a.core.set_rotation(R0, "updating")
        a.state.versions.pending = True  # as after a publication whose answer was lost
        _update(b.core, R1, 7)
        assert await b.state.publish_versions(b.core)  # b ran an update since
        await _rounds(a, n=1)
        assert not a.state.versions.pending and a.core.versions.loaded[R1] == 7
        assert (await a.state.redis.client.hget("f9:versions", "by")) == b.state.router_id
    finally:
        redis.close()


async def test_an_update_lock_whose_release_got_no_answer_is_released_when_redis_is_back(tmp_path):
    """A release lost in a Redis blink of under a second used to hold every router's next
    update off for the lock's whole TTL (60 s of 409s): the sync round sends it again."""
    redis = RedisProcess(tmp_path).start()
    try:
        a = Router(redis.url, "f10:", timeout_s=0.1)
        a.state.redis.breaker.reset_s = 0.2
        await a.state.start(a.app, a.core)
        assert await a.state.acquire_update_lock("a:40", 60.0)
        redis.stop()
        await a.state.release_update_lock("a:40")  # no answer: kept
        assert a.state.versions.unreleased == "a:40"
        redis.cont()
        await asyncio.sleep(0.3)
        await _rounds(a, n=2)
        assert await a.state.update_lock_holder() is None and a.state.versions.unreleased is None
    finally:
        redis.close()


async def test_the_next_update_begins_from_where_the_last_one_ended_even_when_its_end_was_published_late(tmp_path):
    """An update's last snapshot got no answer (Redis SIGSTOPped): its router used to release the
    lock all the same, and another router could begin an update within the next sync round and
    publish from its older view, the last update's replica "updating" in it (out of rotation on
    every router, with no update left to clear it). The lock now waits for that publication, and
    the router taking it reads the newest snapshot before anything else."""
    redis = RedisProcess(tmp_path).start()
    try:
        a, b = await _started_pair(redis.url, "f12:", tight_a=True)
        assert await a.state.acquire_update_lock("a:41", 60.0)
        a.core.set_rotation(R1, "updating")  # the update's hold, read by b
        assert await a.state.publish_versions(a.core)
        await _rounds(b, n=1)
        assert b.core.versions.rotation == {R1: "updating"}
        redis.stop()
        a.core.version_loaded(R1, 7)
        a.core.set_rotation(R1, None)
        a.core.finish_update(7, "keep+salt")
        assert not await a.state.publish_versions(a.core)  # the end: no answer
        redis.cont()
        await asyncio.sleep(0.3)
        await a.state.release_update_lock("a:41")  # Redis answers again, but a's end is not in it
        assert not await b.state.acquire_update_lock("b:42", 60.0)
        assert await a.state.update_lock_holder() == "a:41"
        await _rounds(a, n=1)  # the publication first, then the release
        assert await a.state.update_lock_holder() is None and not a.state.versions.pending
        assert b.core.versions.rotation == {R1: "updating"}  # b has not read a's end in a round
        assert await b.state.acquire_update_lock("b:42", 60.0)
        assert not b.core.versions.rotation and b.core.versions.loaded[R1] == 7  # read on taking it
        assert await b.state.publish_versions(b.core)
        await _rounds(a, b, n=1)
        for r in (a, b):
            assert not r.core.versions.rotation and r.core.versions.loaded[R1] == 7
    finally:
        redis.close()


async def test_a_router_that_stalls_past_its_heartbeat_during_the_wait_is_reported_not_dropped(tmp_path):
    redis = RedisProcess(tmp_path).start()
    try:
        a = Router(redis.url, "f11:")
        await a.state.start(a.app, a.core)
        await a.state.redis.client.zadd("f11:routers", {"frozen": time.time()})  # alive now, then silent
        _update(a.core, R0, 1)
        assert await a.state.publish_versions(a.core, {R0: False})
        assert await a.state.await_marked(timeout_s=a.state.peers.ttl_s + 0.5) == ["frozen"]
    finally:
        redis.close()


async def _started_pair(url: str, prefix: str, tight_a: bool = False) -> tuple[Router, Router]:
    """Two routers on one Redis, both joined. ``tight_a``: A's calls get 0.1 s and its breaker
    a 0.2 s reset (it is the one a SIGSTOPped Redis leaves without an answer)."""
    a, b = Router(url, prefix, timeout_s=0.1) if tight_a else Router(url, prefix), Router(url, prefix)
    if tight_a:
        a.state.redis.breaker.reset_s = 0.2
    await a.state.start(a.app, a.core)
    await b.state.start(b.app, b.core)
    return a, b


async def test_the_update_path_rides_out_an_answer_later_than_a_requests_deadline(tmp_path):
    """A fresh attacker (2 routers and 2 vLLM engines on 2 cores) saw one update in three fail on
    a single answer later than ``router.redis_timeout_s`` (75 ms): a replica left on the old
    version, or a 409 naming no holder. The update's calls (its lock, its publications) wait
    ``background_timeout_s``; a request's still fail at their own deadline."""
    redis = RedisProcess(tmp_path).start()
    try:
        a = Router(redis.url, "f12:", timeout_s=0.05)
        await a.state.start(a.app, a.core)
        assert a.state.versions.control_timeout_s == a.state.background_timeout_s == 0.5
        loop = asyncio.get_running_loop()
        calls = {"lock": lambda: a.state.acquire_update_lock("a:41", 60.0),
                 "publish": lambda: a.state.publish_versions(a.core),
                 "holder": a.state.update_lock_holder,
                 "refresh": lambda: a.state.refresh_update_lock("a:41", 60.0)}
        for name, call in calls.items():
            redis.stop()
            loop.call_later(0.2, redis.cont)  # frozen 4x past a request's deadline
            started = time.monotonic()
            result = await call()
            took = time.monotonic() - started
            assert result == ("a:41" if name == "holder" else True) and 0.15 < took < 0.5, (name, result, took)
            await asyncio.sleep(0.05)
        redis.stop()
        loop.call_later(0.6, redis.cont)
        started = time.monotonic()
        job = await a.route(RequestSpec(list(range(64)), session_id="s"))  # the request path: its own deadline
        # two calls of 0.05 s each (~0.1 s measured on a loaded host); waiting Redis out is >= 0.6 s
        assert job.replica_id is not None and time.monotonic() - started < 0.4
        await asyncio.sleep(0.65)
        await a.state.release_update_lock("a:41", now=True)
        assert await a.state.update_lock_holder() is None
    finally:
        redis.close()
