"""router.state against a real redis-server: pins (first writer wins), versions, the update
lock, load shares. Each "router" here is a RedisState with its own DecisionCore and pool, the
way ``router.app`` wires them, without HTTP (the HTTP paths are in test_ha_*.py)."""

from __future__ import annotations

import json

import asyncio
import itertools

import pytest
from aiohttp import web

from cache_policy.config import PolicyConfig
from cache_policy.core import DecisionCore, ReplicaLoad, RequestSpec
from cache_policy.salts import cache_salt_for_version
from cache_policy.types import ReplicaId
from replicas.replica_set import ReplicaEndpoint
from router import keys
from router.pool import ReplicaPool
from router.state import MemoryState, RedisState, make_state

pytestmark = pytest.mark.asyncio(loop_scope="session")

R0, R1 = ReplicaId("replica-0"), ReplicaId("replica-1")
_prefix = itertools.count()


def endpoints(*urls: str) -> list[ReplicaEndpoint]:
    return [ReplicaEndpoint(ReplicaId(f"replica-{i}"), url, 32, 100, "m") for i, url in enumerate(urls)]


class Router:
    """One router's state: a core, a pool and a RedisState, in a bare app."""

    def __init__(self, url: str, prefix: str, eps=None, timeout_s: float = 1.0) -> None:
        """``timeout_s``: generous by default (these tests check consistency, on a loaded CI
        machine); the fault tests pass a tight one and check what it bounds."""
        eps = eps or endpoints("http://127.0.0.1:1", "http://127.0.0.1:2")
        self.core = DecisionCore(PolicyConfig(queue_timeout_s=5.0))
        for ep in eps:
            self.core.add_replica(ep.replica_id, block_size=32, num_gpu_blocks=100)
        self.app = web.Application()
        self.app[keys.CORE], self.app[keys.POOL] = self.core, ReplicaPool(eps)
        self.state = RedisState(url, prefix=prefix, timeout_s=timeout_s, sync_interval_s=0.1)
        self.state.app = self.app

    async def route(self, spec: RequestSpec, now: float = 0.0):
        seen = await self.state.before_open(self.core, spec)
        job = self.core.open(spec, now)
        assert self.core.place(job, now) is not None
        await self.state.after_place(self.core, job, seen, now)
        return job


def prefix() -> str:
    return f"t{next(_prefix)}:"


async def test_the_first_writer_wins_and_a_router_that_lost_follows_before_dispatch(redis_url):
    p = prefix()
    a, b = Router(redis_url, p), Router(redis_url, p)
    spec = RequestSpec(list(range(64)), group_id="g")
    job_a = a.core.open(spec, 0.0)
    a.core.place(job_a, 0.0)
    won = job_a.replica_id
    b.core.observe_load(won, ReplicaLoad(num_waiting=50), 0.0)  # B alone would choose the other one
    seen_b = await b.state.before_open(b.core, spec)
    job_b = b.core.open(spec, 0.0)
    b.core.place(job_b, 0.0)
    assert job_b.replica_id != won
    await a.state.after_place(a.core, job_a, await a.state.before_open(a.core, spec), 0.0)
    await b.state.after_place(b.core, job_b, seen_b, 0.0)
    assert job_b.replica_id == won and b.core.registry.get("group", "g").replica == won
    assert b.state.pins.moved == 1
    assert await b.state.redis.call(lambda c: c.get(p + "pin:group:g")) == f"{won}|0"


async def test_twenty_groups_claimed_at_once_by_three_routers_each_land_on_one_replica(redis_url):
    p = prefix()
    routers = [Router(redis_url, p) for _ in range(3)]
    for i, r in enumerate(routers):  # each router would place on a different replica by itself
        r.core.observe_load([R0, R1][i % 2], ReplicaLoad(num_waiting=50), 0.0)
    for g in range(20):
        spec = RequestSpec(list(range(64)), group_id=f"g{g}")
        jobs = await asyncio.gather(*(r.route(spec) for r in routers for _ in range(5)))
        assert len({j.replica_id for j in jobs}) == 1, (g, [j.replica_id for j in jobs])


async def test_a_deliberate_move_replaces_the_pin_it_read(redis_url):
    p = prefix()
    a, b = Router(redis_url, p), Router(redis_url, p)
    first = await a.route(RequestSpec(list(range(64)), session_id="s"))
    a.core.finish(first, "ok", 0.0)
    b.core.set_health(first.replica_id, False)  # B sees the pinned replica down: the session moves
    moved = await b.route(RequestSpec(list(range(96)), session_id="s"), 1.0)
    assert moved.replica_id != first.replica_id and moved.decision.reason.value == "repin"
    assert (await a.state.redis.call(lambda c: c.get(p + "pin:session:s"))).startswith(moved.replica_id + "|")
    again = await a.route(RequestSpec(list(range(128)), session_id="s"), 2.0)
    assert again.replica_id == moved.replica_id  # A follows the moved pin at its next turn


async def test_an_update_published_by_one_router_is_applied_by_another_before_it_salts(redis_url):
    p = prefix()
    a, b = Router(redis_url, p), Router(redis_url, p)
    old = await b.route(RequestSpec(list(range(64)), session_id="old"))
    b.core.finish(old, "ok", 0.0)
    a.core.version_loaded(R0, 4)
    a.core.version_loaded(R1, 4)
    a.core.finish_update(4, "keep+salt")
    assert await a.state.publish_versions(a.core)
    new_on_b = await b.route(RequestSpec(list(range(64)), session_id="new"), 1.0)
    old_on_a = await a.route(RequestSpec(list(range(96)), session_id="old"), 1.0)
    assert new_on_b.salt == cache_salt_for_version(4) and b.core.versions.loaded == {R0: 4, R1: 4}
    assert old_on_a.salt == cache_salt_for_version(0)  # keep+salt: the start version B recorded


async def test_the_update_lock_is_one_across_routers_and_only_its_owner_releases_it(redis_url):
    p = prefix()
    a, b = Router(redis_url, p), Router(redis_url, p)
    assert await a.state.acquire_update_lock("a:1", 5.0)
    assert not await b.state.acquire_update_lock("b:1", 5.0)
    assert await b.state.update_lock_holder() == "a:1"
    await b.state.release_update_lock("b:1")
    assert await b.state.update_lock_holder() == "a:1" and not await b.state.refresh_update_lock("b:1", 5)
    assert await a.state.refresh_update_lock("a:1", 0.2)
    await asyncio.sleep(0.35)
    assert await b.state.acquire_update_lock("b:1", 5.0)
    await b.state.release_update_lock("b:1")
    assert await a.state.update_lock_holder() is None


async def test_the_memory_state_has_the_same_lock():
    state = MemoryState()
    assert await state.acquire_update_lock("x", 0.1) and not await state.acquire_update_lock("y", 5)
    await asyncio.sleep(0.15)
    assert await state.acquire_update_lock("y", 5) and await state.update_lock_holder() == "y"
    assert await state.publish_versions(None) is True


async def test_load_shares_of_live_routers_fold_into_each_core_and_a_dead_ones_expire(redis_url):
    p = prefix()
    a, b = Router(redis_url, p), Router(redis_url, p)
    for r in (a, b):
        await r.state.sync_round()
    job = await a.route(RequestSpec(list(range(32 * 10))))
    a.core.admit(job, 0.0)
    await a.state.sync_round()
    await b.state.sync_round()
    assert b.core.admission.ledger.peer(job.replica_id).requests == 1
    assert b.core.admission.ledger.peer(job.replica_id).committed == a.core.admission.ledger.committed(job.replica_id) > 0
    await asyncio.sleep(a.state.peers.ttl_s + 0.1)  # A stops beating (died)
    await b.state.sync_round()
    assert b.core.admission.ledger.peer(job.replica_id).requests == 0


async def test_make_state_validates():
    assert isinstance(make_state("memory", None), MemoryState)
    with pytest.raises(ValueError, match="redis_url"):
        make_state("redis", None)
    with pytest.raises(ValueError, match="router.state"):
        make_state("disk", None)


async def test_a_replica_added_restarted_drained_and_removed_through_one_router_is_followed_by_another(redis_url):
    from replicas.events import ReplicaEvent
    from router.fleet import on_replica_event

    p = prefix()
    a, b = Router(redis_url, p), Router(redis_url, p)
    for r in (a, b):
        await r.state.sync_round()
    r2, r3 = ReplicaId("replica-2"), ReplicaId("replica-3")
    added = ReplicaEndpoint(r2, "http://127.0.0.1:3", 32, 100, "m")  # a registered server: no key
    # one A launched: its key is in A's process only, so B (another process) could not send to it
    on_replica_event(a.app, ReplicaEvent("added", r3, ReplicaEndpoint(r3, "http://127.0.0.1:5", 32, 100, "m",
                                                                      api_key="secret")))
    steps = [("added", added, "http://127.0.0.1:3", None),
             ("restarted", ReplicaEndpoint(r2, "http://127.0.0.1:4", 32, 100, "m"), "http://127.0.0.1:4", None),
             ("draining", None, "http://127.0.0.1:4", "draining")]
    for kind, endpoint, url, rotation in steps:
        on_replica_event(a.app, ReplicaEvent(kind, r2, endpoint or a.app[keys.POOL].get(r2).endpoint))
        if kind == "added":  # A loads a new version on it before B has heard of the replica
            a.core.version_loaded(r2, 5)
            a.core.finish_update(5, "keep+salt")
            assert await a.state.publish_versions(a.core)
        await a.state.sync_round()
        await b.state.sync_round()
        assert b.core.versions.loaded[r2] == 5, kind
        assert r2 in b.core.replicas and b.app[keys.POOL].get(r2).endpoint.base_url == url, kind
        assert b.core.versions.rotation.get(r2) == rotation, kind
    assert r3 not in b.core.replicas and r3 in b.state.registry.unreachable  # not routed to from B
    # and not written back as removed (B does not hold it): A keeps its replica
    assert json.loads((await a.state.redis.call(lambda c: c.hget(p + "replicas", r3))))["state"] == "active"
    await a.state.sync_round()
    assert r3 in a.core.replicas
    assert "secret" not in str(await a.state.redis.call(lambda c: c.hgetall(p + "replicas")))  # keys never travel
    on_replica_event(a.app, ReplicaEvent("removed", r2, a.app[keys.POOL].get(r2).endpoint))
    await a.state.sync_round()
    await b.state.sync_round()
    assert r2 not in b.core.replicas and r2 not in b.app[keys.POOL].ids()
    rounds = a.state.registry.seq.copy()
    await a.state.sync_round()
    await b.state.sync_round()
    assert a.state.registry.seq == rounds  # nothing changed: nothing written again


async def test_status_lists_live_routers_and_names_a_disagreement(redis_url):
    import sys

    p = prefix()
    a, b = Router(redis_url, p), Router(redis_url, p)
    for r in (a, b):
        await r.state.start(r.app, r.core)
    loops = [asyncio.create_task(r.state.run()) for r in (a, b)]

    async def status() -> tuple[int, str]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "router.cli", "status", "--redis-url", redis_url, "--redis-prefix", p,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        return proc.returncode, out.decode() + err.decode()

    try:
        code, out = await status()
        assert code == 0, out
        assert "2 router(s) alive" in out and a.state.router_id in out and b.state.router_id in out
        b.core.version_loaded(R0, 9)  # B's own view differs from A's
        await asyncio.sleep(0.3)
        code, out = await status()
        assert code == 1, out
        line = next(x for x in out.splitlines() if "replica-0 version:" in x)
        assert f"{a.state.router_id}=0" in line and f"{b.state.router_id}=9" in line
    finally:
        for task in loops:
            task.cancel()
        await asyncio.gather(*loops, return_exceptions=True)


async def test_a_removed_replicas_entry_leaves_the_registry_and_every_router_once_it_is_old(redis_url, monkeypatch):
    """A fleet that changes for a week must not keep an entry per replica it ever had, in Redis
    or in any router (``registry.REMOVED_KEPT_S``)."""
    from replicas.events import ReplicaEvent
    from router.fleet import on_replica_event
    from router.state import registry

    p = prefix()
    a, b = Router(redis_url, p), Router(redis_url, p)
    r2 = ReplicaId("replica-2")
    on_replica_event(a.app, ReplicaEvent("added", r2, ReplicaEndpoint(r2, "http://127.0.0.1:3", 32, 100, "m")))
    for r in (a, b, a, b):
        await r.state.sync_round()
    on_replica_event(a.app, ReplicaEvent("removed", r2, a.app[keys.POOL].get(r2).endpoint))
    await a.state.sync_round()
    await b.state.sync_round()
    assert r2 not in b.core.replicas and b.state.registry.known[r2]["state"] == "removed"
    assert r2 in await a.state.redis.call(lambda c: c.hkeys(p + "replicas"))  # young: kept
    monkeypatch.setattr(registry, "REMOVED_KEPT_S", 0.0)  # now old
    for r in (b, a, b):
        await r.state.sync_round()
    assert r2 not in await a.state.redis.call(lambda c: c.hkeys(p + "replicas"))
    for r in (a, b):
        assert r2 not in r.state.registry.known and r2 not in r.state.registry.seq
    assert sorted(await a.state.redis.call(lambda c: c.hkeys(p + "replicas"))) == [R0, R1]  # the others stay


async def test_a_publication_carries_the_folders_of_the_versions_still_served(redis_url):
    # a fresh attacker: router B's refused commit of a version router A had loaded found no folder
    # to restore (routers shared versions, not folders) and left the replica paused with undefined
    # weights. Each publication carries the folders of versions still served (or current)
    p = prefix()
    a, b = Router(redis_url, p), Router(redis_url, p)
    await a.state.start(a.app, a.core)
    await b.state.start(b.app, b.core)
    a.core.version_loaded(R0, 1)
    a.core.finish_update(1, "keep+salt")
    assert await a.state.publish_versions(a.core, None, {0: "/ckpt/v0", 1: "/ckpt/v1", 7: "/ckpt/gone"})
    await b.state.sync_round()
    assert b.core.versions.loaded[R0] == 1
    assert (b.state.shared_folder(0), b.state.shared_folder(1), b.state.shared_folder(7)) == ("/ckpt/v0", "/ckpt/v1", None)
    # version 0 no longer served anywhere: forgotten (bounded by the replicas, not the updates)
    a.core.version_loaded(R1, 1)
    assert await a.state.publish_versions(a.core)
    await b.state.sync_round()
    assert (b.state.shared_folder(0), b.state.shared_folder(1)) == (None, "/ckpt/v1")
    assert sorted(b.state.versions.folders) == [1]
