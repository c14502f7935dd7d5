"""Routers alive, their view and their in-flight share per replica (issue 13).

Each sync round a router writes, with a TTL of ``ttl_s`` (a few rounds): a heartbeat in the
``routers`` zset, its view (``router:<id>``: versions, replicas, in flight; read by
``rollout-router status``) and its in-flight share per replica (``load:<id>``). It reads the
shares of the other live routers and folds their sum into its core's admission projection
(``DecisionCore.set_peer_loads``), so N routers together respect the watermark. A router that
dies stops refreshing: its share expires with its keys after ``ttl_s``. While Redis is
unreachable the last shares read are kept for ``ttl_s``, then dropped.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

from cache_policy.core import DecisionCore
from cache_policy.sharing import PeerLoad, sum_peer_loads
from cache_policy.types import ReplicaId
from router.state.redis_client import GuardedRedis
from router.state.wire import Keys


def new_router_id() -> str:
    """``<host>:<pid>:<random>``, unique per router process."""
    return f"{socket.gethostname()}:{os.getpid()}:{os.urandom(3).hex()}"


def view_of(app, router_id: str, epoch: int, confirmed: bool, address: str | None = None,
            registry_seq: dict | None = None) -> dict[str, Any]:
    """What ``rollout-router status`` shows for one router; ``address``: where it serves;
    ``registry_seq``: per replica, the newest registry entry this router applied (a drain on
    another router waits until every router applied its ``draining`` and has nothing left there:
    ``RedisState.drained_everywhere``)."""
    seqs = registry_seq or {}
    from router import keys

    core, pool = app[keys.CORE], app[keys.POOL]
    return {
        "router": router_id, "address": address, "pid": os.getpid(), "time": time.time(), "epoch": epoch, "versions_confirmed": confirmed,
        "current_version": core.versions.current, "policy": core.versions.policy,
        "replicas": {s.endpoint.replica_id: {
            "url": s.endpoint.base_url, "version": core.versions.loaded.get(s.endpoint.replica_id),
            "healthy": s.endpoint.replica_id in core.replicas and core.replicas[s.endpoint.replica_id].healthy,
            "rotation": core.versions.rotation.get(s.endpoint.replica_id),
            "in_flight": core.in_flight(s.endpoint.replica_id),
            "registry_seq": seqs.get(s.endpoint.replica_id, 0)} for s in pool.states()},
    }


class PeerSync:
    """Heartbeat, view and load shares of this router; the others' shares into the core."""

    def __init__(self, redis: GuardedRedis, keys: Keys, router_id: str, ttl_s: float) -> None:
        self.redis, self.keys, self.router_id, self.ttl_s = redis, keys, router_id, ttl_s
        self.others: list[str] = []
        self._read_at = float("-inf")

    async def beat(self, app, core: DecisionCore, view: dict[str, Any], timeout_s: float,
                   marked: int | None = None) -> list[str]:
        """Write heartbeat, view, share and (when given) the versions epoch this router confirmed
        (``marked:<id>``, ``RedisState.await_marked``); read the others' shares into ``core``.
        Returns the other live routers' ids. Raises StateUnavailable."""
        now = time.time()
        share = json.dumps({rid: load.as_list() for rid, load in core.own_loads().items()})
        ttl_ms = max(1, int(self.ttl_s * 1000))

        async def write(c):
            pipe = c.pipeline(transaction=False)
            pipe.zadd(self.keys.routers, {self.router_id: now})
            pipe.set(self.keys.router(self.router_id), json.dumps(view), px=ttl_ms)
            pipe.set(self.keys.load(self.router_id), share, px=ttl_ms)
            if marked is not None:
                pipe.set(self.keys.marked(self.router_id), marked, px=ttl_ms)
            pipe.zremrangebyscore(self.keys.routers, "-inf", now - 60 * self.ttl_s)
            pipe.zrangebyscore(self.keys.routers, now - self.ttl_s, "+inf")
            return await pipe.execute()

        alive = (await self.redis.call(write, timeout_s=timeout_s, background=True))[-1]
        self.others = [r for r in alive if r != self.router_id]
        raw = await self.redis.call(lambda c: c.mget([self.keys.load(r) for r in self.others]),
                                    timeout_s=timeout_s, background=True) if self.others else []
        shares = []
        for text in raw:
            if text:
                shares.append({ReplicaId(rid): PeerLoad(*map(int, v)) for rid, v in json.loads(text).items()})
        core.set_peer_loads(sum_peer_loads(shares))
        self._read_at = time.monotonic()
        return self.others

    def stale(self, core: DecisionCore) -> None:
        """Redis unreachable: drop the others' shares once they are older than ``ttl_s``."""
        if time.monotonic() - self._read_at > self.ttl_s:
            core.set_peer_loads({})

    async def leave(self) -> None:
        """Remove this router's heartbeat, view and share (clean shutdown). Raises StateUnavailable."""
        async def run(c):
            pipe = c.pipeline(transaction=False)
            pipe.zrem(self.keys.routers, self.router_id)
            pipe.delete(self.keys.router(self.router_id), self.keys.load(self.router_id))
            return await pipe.execute()
        await self.redis.call(run)


async def read_status(redis: GuardedRedis, keys: Keys, ttl_s: float, **call) -> list[dict[str, Any]]:
    """Every live router's view (``rollout-router status``); ``call``: ``GuardedRedis.call``'s
    options (``timeout_s``, ``background``). Raises StateUnavailable."""
    now = time.time()
    alive = await redis.call(lambda c: c.zrangebyscore(keys.routers, now - ttl_s, "+inf"), **call)
    views = await redis.call(lambda c: c.mget([keys.router(r) for r in alive]), **call) if alive else []
    return [json.loads(v) for v in views if v]
