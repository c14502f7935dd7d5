"""The replica registry across routers: added, restarted (new URL), draining, removed (issue 13).

Each sync round compares this router's fleet (its pool and the core's rotation) with the
registry as last synced: what changed here is written (``PUT_REPLICA``, stamped with the next
``replicas:seq``); entries other routers wrote since are carried into this router through the
same path as the replica set's own events (``router.fleet.on_replica_event``), so a replica
added or restarted through one router is used by all. Health is not shared: each router sees
each replica itself. Replica keys (``ReplicaEndpoint.api_key``) are never written to Redis.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from typing import Any

from cache_policy.types import ReplicaId
from replicas.addresses import resolve
from replicas.auth import headers_for
from replicas.kv_events import KvEventSource
from replicas.replica_set import ReplicaEndpoint
from router.state.redis_client import GuardedRedis
from router.state.wire import (CLAIM_ADDRESSES, CLAIM_REPLICA_INDEX, DROP_REPLICA, PUT_REPLICA, RELEASE_ADDRESSES,
                               Keys)

log = logging.getLogger(__name__)

REMOVED_KEPT_S = 3600.0
"""How long a ``removed`` entry stays in the registry (every live router has read it long before);
then the first router to see it that old deletes it, and every router forgets it: a fleet that
changes for a week keeps no entry per replica it ever had."""

FIELDS = ("replica_id", "base_url", "block_size", "num_gpu_blocks", "model", "scoring_cap", "kv_events")


def entry_of(endpoint: ReplicaEndpoint, state: str) -> dict[str, Any]:
    """The registry entry of ``endpoint`` (no key, no seq): endpoint fields, ``state``, and
    ``keyed``: whether it needs a key (one launched by a router: only that router's process holds it)."""
    out = {f: getattr(endpoint, f) for f in FIELDS}
    out["kv_events"] = dataclasses.asdict(endpoint.kv_events) if endpoint.kv_events is not None else None
    out["keyed"] = endpoint.api_key is not None
    out["state"] = state
    return out


def endpoint_of(entry: dict[str, Any], key: str | None) -> ReplicaEndpoint:
    """A ``ReplicaEndpoint`` from a registry entry (``key``: the replica key known here, if any)."""
    kv = entry.get("kv_events")
    return ReplicaEndpoint(ReplicaId(entry["replica_id"]), entry["base_url"], int(entry["block_size"]),
                           int(entry["num_gpu_blocks"]), entry["model"], bool(entry["scoring_cap"]),
                           KvEventSource(**kv) if kv else None, key)


def local_view(app) -> dict[ReplicaId, dict[str, Any]]:
    """This router's fleet as registry entries."""
    from router import keys

    core, pool = app[keys.CORE], app[keys.POOL]
    out = {}
    for s in pool.states():
        rid = s.endpoint.replica_id
        if rid in core.replicas:
            out[rid] = entry_of(s.endpoint, "draining" if core.versions.rotation.get(rid) == "draining" else "active")
    return out


class RegistrySync:
    """Registry entries between this router's fleet and Redis."""

    def __init__(self, redis: GuardedRedis, keys: Keys, router_id: str) -> None:
        self.redis, self.keys, self.router_id = redis, keys, router_id
        self.known: dict[ReplicaId, dict[str, Any]] = {}
        """Entries as last synced (without ``seq``/``by``), per replica."""
        self.seq: dict[ReplicaId, int] = {}
        self.unreachable: dict[ReplicaId, str] = {}
        """Replicas another router launched (keyed) that this one cannot send to (logged once), and
        their URLs."""
        self.alive: set[str] = set()
        """The other routers alive at the last heartbeat (``PeerSync.others``; the caller sets it)."""
        self.joining = True
        """Until a push of this router's lands with nothing refused: its writes must not take an id
        that another live router holds at another URL (``wire.PUT_REPLICA``). Later writes are
        informed (the router has read the registry): a launched replica's restart moves its own
        entry, whoever wrote it last."""
        self.refused: set[ReplicaId] = set()
        """Entries the last :meth:`push` could not write: another live router holds the id at
        another URL (``wire.PUT_REPLICA``); the next :meth:`pull` reads its entry."""
        self.conflicts: dict[ReplicaId, tuple[str, str]] = {}
        """Replicas of this router's own set that a live router registered at another address:
        ``(that router, its URL)`` (:meth:`_conflict`)."""

    def servers_elsewhere(self) -> dict[str, ReplicaId]:
        """The URLs of the registry's entries this router does not follow, each with its id:
        keyed replicas of another router (:attr:`unreachable`) and another live router's server
        under an id of this router's own set (:attr:`conflicts`). Each is one engine of the
        fleet already: ``POST /admin/replicas`` of one must not give it a second id."""
        out = {url: rid for rid, url in self.unreachable.items()}
        out.update({url: rid for rid, (_, url) in self.conflicts.items()})
        return out

    def forget(self) -> None:
        """Redis restarted empty: everything local is written again next round."""
        self.known.clear()
        self.seq.clear()

    async def push(self, app, timeout_s: float) -> int:
        """Write what changed in this router's fleet since the last sync. Raises StateUnavailable."""
        local = local_view(app)
        changes = {rid: e for rid, e in local.items() if self.known.get(rid) != e}
        for rid, e in self.known.items():
            if rid not in local and e["state"] != "removed":
                changes[rid] = {**e, "state": "removed"}
        self.refused.clear()
        joining = self.router_id if self.joining else ""
        for rid, entry in changes.items():
            body = json.dumps({**entry, "by": self.router_id, "at": round(time.time(), 3)})
            seq = int(await self.redis.call(lambda c: c.eval(
                PUT_REPLICA, 2, self.keys.replicas, self.keys.replicas_seq, rid, body, self.keys.events,
                joining, self.keys.router("")), timeout_s=timeout_s, background=True))
            if seq == 0:  # a live router holds the id at another URL: read its entry again next (pull)
                self.refused.add(rid)
                self.seq.pop(rid, None)  # read while that router did not look alive yet, maybe
                continue
            self.seq[rid] = seq
            self.known[rid] = entry
        self.joining = bool(self.refused)  # until its entries are in, or given up for the others
        return len(changes) - len(self.refused)

    async def claim_index(self, floor: int, timeout_s: float) -> int:
        """A replica index at least ``floor`` that no router has used (``wire.CLAIM_REPLICA_INDEX``).
        Raises StateUnavailable."""
        return int(await self.redis.call(lambda c: c.eval(
            CLAIM_REPLICA_INDEX, 2, self.keys.replicas, self.keys.replicas_next, floor), timeout_s=timeout_s))

    async def claim_addresses(self, addresses: list[str], owner: str, ttl_s: float, timeout_s: float) -> bool:
        """Hold ``addresses`` (a server being added) as ``owner`` (one token per claim) for
        ``ttl_s`` unless any of them is held (False). Raises StateUnavailable."""
        keys = [self.keys.adding(a) for a in addresses]
        return bool(await self.redis.call(lambda c: c.eval(
            CLAIM_ADDRESSES, len(keys), *keys, owner, max(1, int(ttl_s * 1000))), timeout_s=timeout_s))

    async def release_addresses(self, addresses: list[str], owner: str, after_s: float, timeout_s: float) -> None:
        """Let go of ``owner``'s holds on ``addresses`` ``after_s`` seconds from now (0: at once;
        ``wire.RELEASE_ADDRESSES``: a hold another claim took is left alone). Raises
        StateUnavailable."""
        keys = [self.keys.adding(a) for a in addresses]
        ms = max(1, int(after_s * 1000)) if after_s > 0 else 0
        await self.redis.call(lambda c: c.eval(RELEASE_ADDRESSES, len(keys), *keys, owner, ms), timeout_s=timeout_s)

    async def pull(self, app, timeout_s: float) -> int:
        """Carry entries other routers wrote since the last sync into this router. Raises StateUnavailable."""
        raw = await self.redis.call(lambda c: c.hgetall(self.keys.replicas), timeout_s=timeout_s, background=True)
        applied, old = 0, []
        for rid, (by, _) in list(self.conflicts.items()):
            if by not in self.alive:  # the router that held the id is gone: this router's entry goes in
                del self.conflicts[rid]
                self.known.pop(rid, None)
        for rid in [r for r, e in self.known.items() if e["state"] == "removed" and r not in raw]:
            self.known.pop(rid)  # deleted from the registry (REMOVED_KEPT_S): forgotten here too
            self.seq.pop(rid, None)
        for rid, text in raw.items():
            try:
                entry = json.loads(text)
                seq = int(entry.pop("seq"))
                by = str(entry.pop("by", None) or "")
                at = float(entry.pop("at", None) or 0.0)
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("ignoring a malformed registry entry for %r: %r", rid, exc)
                continue
            if entry.get("state") == "removed" and 0 < at < time.time() - REMOVED_KEPT_S:
                old.append((rid, text))
            rid = ReplicaId(rid)
            if seq <= self.seq.get(rid, 0):
                continue
            self.seq[rid] = seq
            if self.known.get(rid) != entry:
                entry = await self._spelt_here(app, rid, entry, by)
                try:
                    if not self._apply(app, rid, entry, by):
                        continue
                except (ValueError, KeyError, TypeError) as exc:
                    log.warning("could not follow registry entry %s: %r", rid, exc)
                    continue
                applied += 1
            self.known[rid] = entry
        for rid, text in old:
            await self.redis.call(lambda c: c.eval(DROP_REPLICA, 1, self.keys.replicas, rid, text),
                                  timeout_s=timeout_s, background=True)
        return applied

    async def _spelt_here(self, app, rid: ReplicaId, entry: dict[str, Any], by: str) -> dict[str, Any]:
        """``entry`` with this router's URL when it names, in another spelling, the server this
        router's own set holds as ``rid`` (``localhost`` vs ``127.0.0.1``: their addresses meet,
        ``replicas.addresses.resolve``); else ``entry`` as it is. Not a conflict then, and not a
        restart: each router keeps its spelling and neither writes the entry again."""
        from router import keys

        here = {s.endpoint.replica_id: s.endpoint for s in app[keys.POOL].states()}
        local = self._own_elsewhere(app, here, rid, entry, by)
        if local is None:
            return entry
        try:
            here, there = await asyncio.gather(resolve(local.base_url), resolve(str(entry["base_url"])))
        except (OSError, ValueError, KeyError):
            return entry  # a name that does not resolve is another server as far as can be told
        return {**entry, "base_url": local.base_url} if here & there else entry

    def _own_elsewhere(self, app, here: dict[ReplicaId, ReplicaEndpoint], rid: ReplicaId, entry: dict[str, Any],
                       by: str) -> ReplicaEndpoint | None:
        """This router's endpoint of ``rid`` when ``entry``, written by another router and not a
        removal, puts ``rid``, a replica of this router's own set (``fleet.owns``), at another URL;
        else None. ``here``: the pool's endpoints by id."""
        from router.fleet import FLEET

        fleet, local = app.get(FLEET), here.get(rid)
        if (local is None or fleet is None or by == self.router_id or entry.get("state") == "removed"
                or local.base_url == entry.get("base_url") or not fleet.owns(rid)):
            return None
        return local

    def _apply(self, app, rid: ReplicaId, entry: dict[str, Any], by: str = "") -> bool:
        """Carry ``entry`` (written by router ``by``) into this router; False when it is not
        followed (a removal of ours not yet pushed, a keyed replica this router cannot reach, a
        :meth:`_conflict`): it must not count as synced, since :meth:`push` writes back every known
        entry this router does not hold as ``removed``."""
        from replicas.events import ReplicaEvent
        from router import keys
        from router.fleet import FLEET, on_replica_event, stop_owned

        pool, core = app[keys.POOL], app[keys.CORE]
        here = {s.endpoint.replica_id: s.endpoint for s in pool.states()}
        state = entry["state"]
        if state == "removed":  # (the last one too: a fleet of none answers 503, not a replica it was told is gone)
            self.unreachable.pop(rid, None)
            if rid in here:
                on_replica_event(app, ReplicaEvent("removed", rid, here[rid], "removed by another router"))
            fleet = app.get(FLEET)
            if fleet is not None and fleet.owns(rid):  # ours: another router removed it, we stop it
                stop_owned(app, fleet, rid)
            return True
        local = here.get(rid)
        if self._own_elsewhere(app, here, rid, entry, by) is not None:
            return self._conflict(app, rid, local.base_url, entry["base_url"], by)
        self.conflicts.pop(rid, None)
        if local is None and self.known.get(rid, {}).get("state", "removed") != "removed":
            return False  # this router removed it since its last push: its 'removed' goes out next, not back in
        if local is None and entry.get("keyed") and not headers_for(entry["base_url"]):
            if self.unreachable.get(rid) != entry["base_url"]:  # every request there would get its 401
                self.unreachable[rid] = entry["base_url"]
                log.info("replica %s at %s was launched by another router and needs its key, which only that "
                         "router's process holds: not routed from here", rid, entry["base_url"])
            return False  # not synced: recorded as known, the next push would write it back 'removed' (its owner would stop it)
        self.unreachable.pop(rid, None)
        endpoint = endpoint_of(entry, local.api_key if local is not None else None)
        if local is None or rid not in core.replicas:
            log.warning("replica %s at %s added by another router", rid, endpoint.base_url)
            on_replica_event(app, ReplicaEvent("added", rid, endpoint))
        elif local.base_url != endpoint.base_url:
            log.warning("replica %s restarted at %s (another router)", rid, endpoint.base_url)
            on_replica_event(app, ReplicaEvent("restarted", rid, endpoint))
        if state == "draining" and core.versions.rotation.get(rid) != "draining":
            on_replica_event(app, ReplicaEvent("draining", rid, endpoint))
        elif state == "active" and core.versions.rotation.get(rid) == "draining":
            core.set_rotation(rid, None)
        return True

    def _conflict(self, app, rid: ReplicaId, here_url: str, there_url: str, by: str) -> bool:
        """Router ``by`` registered ``rid``, a replica of this router's own set, at ``there_url``;
        it is ``here_url`` here. Only the router whose set holds a replica moves it to a new
        address (a launched replica's restart), so this is two routers giving one id to two
        servers: the ids of ``replicas.urls`` and of launched replicas are positional, and the
        routers were started with different lists (or each launched its own replicas). Following
        it (as a restart, before) silently moved this router's replica to the other's server,
        and pins, load shares and drains by id then meant two servers. ``by`` alive: not
        followed, said once in the log, and ``rid`` stays in the registry as ``by`` wrote it
        (this router writes nothing for it: no tug of war); ``RedisState.start`` refuses to
        start on it. ``by`` gone (a router stopped with another list): this router's entry
        replaces it at the next push. Returns False (the entry is not synced)."""
        if by in self.alive:
            if self.conflicts.get(rid) != (by, there_url):
                log.error("replica %s is %s on this router but %s in the shared registry (router %s): routers "
                          "sharing one Redis prefix must list the same replicas.urls in the same order, and only one "
                          "of them may launch replicas; this router keeps %s", rid, here_url, there_url, by, here_url)
            self.conflicts[rid] = (by, there_url)
            self.known[rid] = local_view(app).get(rid) or self.known.get(rid, {})
        else:
            self.conflicts.pop(rid, None)
            self.known.pop(rid, None)  # written again from this router's fleet at the next push
        return False
