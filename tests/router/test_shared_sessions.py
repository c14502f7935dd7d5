"""A session ended on one router is ended on all of them (``router.state.pins.PinSync.end``):
two served routers sharing a real redis-server, real HTTP on loopback, a fake replica that
records what it was sent. A fresh attacker found a DELETE left the shared pin (and its start
version) in Redis: the other router kept the session, and a new session under the same id came
back with the old one's start version (keep+salt: its salt, over a newer version's weights)."""

from __future__ import annotations

import asyncio
import itertools

import aiohttp
import pytest

from cache_policy.salts import cache_salt_for_version
from cache_policy.types import ReplicaId
from router import keys
from tests.router.edge_fixtures import edge_router, fake_replica

pytestmark = pytest.mark.asyncio(loop_scope="session")

R0 = ReplicaId("replica-0")
_prefixes = itertools.count()


async def _complete(http: aiohttp.ClientSession, url: str, session: str, prompt: list[int], **headers: str) -> int:
    async with http.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1},
                         headers={"X-Session-Id": session, **headers}) as r:
        await r.read()
        return r.status


async def _until(check, timeout_s: float = 3.0) -> bool:
    for _ in range(int(timeout_s / 0.02)):
        if check():
            return True
        await asyncio.sleep(0.02)
    return check()


def _live(app, session: str) -> bool:
    rec = app[keys.CORE].registry.record_of("session", session)
    return rec is not None and not rec.ended and rec.replica is not None


async def test_a_session_ended_on_one_router_is_ended_on_every_router_and_starts_fresh(redis_url):
    prefix = f"ss{next(_prefixes)}:"
    shared = {"state": "redis", "redis_url": redis_url, "redis_prefix": prefix, "state_sync_interval_s": 0.1}
    async with fake_replica() as replica, edge_router(replica, **shared) as (url_a, a), \
            edge_router(replica, **shared) as (url_b, b), aiohttp.ClientSession() as http:
        redis = a[keys.LIFECYCLE].shared.redis.client
        prompt = list(range(100, 164))
        assert await _complete(http, url_a, "s", prompt) == 200
        assert await _complete(http, url_b, "s", prompt + [7] * 40) == 200  # b follows the shared pin
        assert _live(a, "s") and _live(b, "s") and await redis.get(f"{prefix}pin:session:s") == f"{R0}|0"

        async with http.delete(url_a + "/v1/sessions/s") as r:
            assert r.status == 200 and (await r.json())["ended"] is True
        assert await redis.get(f"{prefix}pin:session:s") is None
        assert await _until(lambda: not _live(b, "s")), "the other router kept the session"

        for app in (a, b):  # an update lands: new sessions start under version 1
            core = app[keys.CORE]
            core.version_loaded(R0, 1)
            core.finish_update(1, "keep+salt")
        assert await a[keys.LIFECYCLE].shared.publish_versions(a[keys.CORE])
        assert await _complete(http, url_b, "s", list(range(200, 264))) == 200  # the same id, a new session
        assert replica.bodies[-1]["cache_salt"] == cache_salt_for_version(1)
        assert await redis.get(f"{prefix}pin:session:s") == f"{R0}|1"

        # its last turn says so (X-Session-End) on b: ended on a as well, the pin gone
        assert await _complete(http, url_a, "s", list(range(200, 264)) + [9] * 40) == 200
        assert _live(a, "s")
        assert await _complete(http, url_b, "s", list(range(200, 264)) + [9] * 80, **{"X-Session-End": "true"}) == 200
        assert await _until(lambda: not _live(a, "s")), "the other router kept the session its last turn ended"
        assert await _until_none(redis, f"{prefix}pin:session:s")


async def _until_none(redis, key: str) -> bool:
    for _ in range(150):
        if await redis.get(key) is None:
            return True
        await asyncio.sleep(0.02)
    return False


async def test_a_delete_on_a_router_that_never_saw_the_session_still_ends_it_everywhere(redis_url):
    prefix = f"ss{next(_prefixes)}:"
    shared = {"state": "redis", "redis_url": redis_url, "redis_prefix": prefix, "state_sync_interval_s": 0.1}
    async with fake_replica() as replica, edge_router(replica, **shared) as (url_a, a), \
            edge_router(replica, **shared) as (url_b, b), aiohttp.ClientSession() as http:
        assert await _complete(http, url_a, "t", list(range(300, 364))) == 200
        # b may have adopted the pin from a's announcement; drop it so b holds nothing of "t"
        b[keys.CORE].registry.end("session", "t")
        async with http.delete(url_b + "/v1/sessions/t") as r:
            assert (await r.json())["ended"] is True  # Redis held its pin
        assert await _until(lambda: not _live(a, "t"))
        async with http.delete(url_b + "/v1/sessions/t") as r:
            assert (await r.json())["ended"] is False  # nothing left anywhere


async def test_a_session_ended_while_redis_is_away_ends_on_that_router_only_and_never_later(tmp_path):
    """An end sent once Redis is back could not tell the ended session from a new one another
    router started under the id meanwhile (a fresh attacker saw the new session ended after its
    first turn): an end made while Redis is unreachable stays local; the pin expires by its TTL."""
    from tests.router.ha_redis import RedisProcess

    redis = RedisProcess(tmp_path).start()
    prefix = "down:"
    shared = {"state": "redis", "redis_url": redis.url, "redis_prefix": prefix, "state_sync_interval_s": 0.1,
              "redis_timeout_s": 0.1, "redis_breaker_reset_s": 0.2}
    try:
        async with fake_replica() as replica, edge_router(replica, **shared) as (url_a, a), \
                edge_router(replica, **shared) as (url_b, b), aiohttp.ClientSession() as http:
            assert await _complete(http, url_a, "s", list(range(100, 164))) == 200
            assert await _until(lambda: _live(b, "s"))  # b adopted the pin (pub/sub)
            redis.stop()
            async with http.delete(url_a + "/v1/sessions/s") as r:
                assert (await r.json())["ended"] is True  # on a
            assert not _live(a, "s") and _live(b, "s")
            assert await _complete(http, url_b, "s", list(range(500, 564))) == 200  # the id reused on b
            redis.cont()
            await asyncio.sleep(1.0)  # breakers close, sync rounds run: nothing ends it later
            assert _live(b, "s")
    finally:
        redis.close()
