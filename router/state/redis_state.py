"""``router.state: redis``: what several routers share, and how each keeps serving without it.

Request path (``router.lifecycle``): :meth:`before_open` (one MGET: version epoch + pins, then
a newer version snapshot if any) and :meth:`after_place` (the pin claim). Background
(:meth:`run`, a cleanup context of the app): every ``router.state_sync_interval_s`` one sync
round (heartbeat, view, load shares, versions, replica registry, reconcile) and a pub/sub
listener (pins, versions and registry entries other routers write, applied at once).
Every call has ``router.redis_timeout_s``; failures open a breaker (``redis_client``), and the
router then decides from its own core alone. See README "Several routers, one state".
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from cache_policy.core import DecisionCore, Job, RequestSpec
from cache_policy.sharing import left_paused
from router.state.peers import PeerSync, new_router_id, read_status, view_of
from router.state.pins import PinSync, Seen
from router.state.redis_client import GuardedRedis, StateUnavailable
from router.state.registry import RegistrySync
from router.state.versions import VersionSync
from router.state.wire import Keys, parse_event

log = logging.getLogger(__name__)

MARK_TIMEOUT_S = 3.0
"""How long an update waits for the other routers to confirm a new version before it resumes the
engine: a sync round or two (a router that missed the pub/sub message) and a kept stream's quiet
wait (``Lifecycle.mark_new_spans``, at most 2 s)."""


class RedisState:
    """Shared state in Redis for one router process (see the module docstring)."""

    def __init__(self, url: str, *, prefix: str = "rollout-router:", timeout_s: float = 0.075,
                 breaker_failures: int = 3, breaker_reset_s: float = 1.0, pin_ttl_s: int = 3600,
                 sync_interval_s: float = 0.25, router_id: str | None = None) -> None:
        self.router_id = router_id or new_router_id()
        self.address: str | None = None
        """Where this router serves (``http://host:port``, set once bound), in its view for the others."""
        self.keys = Keys(prefix)
        self.sync_interval_s = sync_interval_s
        self.redis = GuardedRedis(url, timeout_s=timeout_s, failures=breaker_failures, reset_s=breaker_reset_s,
                                  on_back=self._on_back)
        self.background_timeout_s = max(0.5, 10 * timeout_s)
        self.pins = PinSync(self.redis, self.keys, pin_ttl_s)
        self.versions = VersionSync(self.redis, self.keys, self.router_id, self._changed, self._applied)
        self.versions.control_timeout_s = self.background_timeout_s
        self.registry = RegistrySync(self.redis, self.keys, self.router_id)
        self.peers = PeerSync(self.redis, self.keys, self.router_id, max(1.0, 4 * sync_interval_s))
        # ttl_s: a router that stopped beating for 4 rounds (>= 1 s) is gone, with its load share
        self.app = None
        self.instance: str | None = None
        self._reconcile = False
        self._republish_all = False
        self.rounds = 0
        self.restarts_seen = 0
        self._marked = -1
        """The newest epoch this router applied and confirmed (``marked:<id>``)."""
        self._claims = 0
        self._held: dict[tuple[str, ...], str] = {}
        """Address holds of servers being added through this router: their claim's owner token."""
        self._unsure_claims: list[tuple[list[str], str]] = []
        """Address claims that got no answer (Redis timed out), with their owner token: each sync
        round lets them go (that claim's holds only) until Redis answers; before, a claim that
        landed with its answer lost blocked adding that server from any router for
        ``router.fleet.ADD_HOLD_S`` (120 s)."""
        self._marking: set[asyncio.Task] = set()
        self._logged: set[str] = set()

    @property
    def available(self) -> bool:
        """False while Redis is unreachable (breaker open)."""
        return self.redis.available

    # -- request path ----------------------------------------------------------------------------

    async def before_open(self, core: DecisionCore, spec: RequestSpec) -> Seen:
        """Before ``core.open``: confirm versions and adopt the request's pins. Never raises."""
        seen, (epoch,) = await self.pins.read(core, spec, [self.keys.versions_epoch])
        if seen.ok:
            await self.versions.observe(core, epoch)  # rare (after an update): one more read
        return seen

    async def after_place(self, core: DecisionCore, job: Job, seen: Seen | None, now: float) -> None:
        """After ``core.place``: claim the pins; follow another router's winning pin. Never raises."""
        await self.pins.claim(core, job, seen, now)

    async def end_session(self, session_id: str) -> bool:
        """The client ended ``session_id`` (on this router): its shared pin goes and every router
        ends it (``PinSync.end``). True when Redis held its pin. Never raises."""
        return await self.pins.end(session_id)

    # -- the weight updater's API (/work/helpers/STATE-API.md) -------------------------------------

    async def acquire_update_lock(self, owner: str, ttl_s: float) -> bool:
        """One update across all routers, begun from the newest snapshot: ``VersionSync.acquire_lock``."""
        from router import keys

        return await self.versions.acquire_lock(owner, ttl_s, self.app[keys.CORE] if self.app is not None else None)

    async def refresh_update_lock(self, owner: str, ttl_s: float) -> bool:
        """Extend ``owner``'s lock by ``ttl_s``; False if it lost it or Redis is unreachable."""
        return await self.versions.refresh_lock(owner, ttl_s)

    async def release_update_lock(self, owner: str, now: bool = False) -> None:
        """Release the lock if ``owner`` holds it, once this router's last publication landed
        unless ``now`` (``VersionSync.release_lock``); never raises (it expires anyway)."""
        await self.versions.release_lock(owner, now=now)

    async def update_lock_holder(self) -> str | None:
        """Who holds the update lock (None: free, or Redis unreachable)."""
        return await self.versions.lock_holder()

    async def address_of(self, router_id: str) -> str | None:
        """Where router ``router_id`` serves, from its last heartbeat's view (None: unknown, gone,
        or Redis unreachable)."""
        try:
            raw = await self.redis.call(lambda c: c.get(self.keys.router(router_id)))
            address = json.loads(raw).get("address") if raw else None
        except (StateUnavailable, ValueError, AttributeError):
            return None
        return address if isinstance(address, str) else None

    # -- the fleet's API (router.fleet: /admin/replicas) -------------------------------------------

    async def claim_replica_index(self, floor: int) -> int:
        """A replica index at least ``floor`` no router sharing this state has used
        (``RegistrySync.claim_index``). Raises StateUnavailable."""
        return await self.registry.claim_index(floor, self.background_timeout_s)

    async def claim_server(self, addresses: list[str], ttl_s: float) -> bool:
        """Hold the socket addresses of a server being added (``ip:port/path``) on every router
        for ``ttl_s``; False when another router is adding a server at one of them. Raises
        StateUnavailable; that claim may have landed with its answer lost, so it is let go at the
        next sync rounds Redis answers (:attr:`_unsure_claims`), not held ``ttl_s``."""
        self._claims += 1
        owner = f"{self.router_id}:{self._claims}"
        try:
            held = await self.registry.claim_addresses(addresses, owner, ttl_s, self.background_timeout_s)
        except StateUnavailable:
            self._unsure_claims.append((addresses, owner))
            raise
        if held:
            self._held[tuple(addresses)] = owner
        return held

    async def release_server(self, addresses: list[str], added: bool) -> None:
        """Let go of :meth:`claim_server`'s hold: at once when the server was not added, else after
        a few sync rounds (every router has it in its registry by then). Never raises (it expires)."""
        owner = self._held.pop(tuple(addresses), None)
        if owner is None:
            return
        try:
            await self.registry.release_addresses(addresses, owner, 4 * max(self.sync_interval_s, 0.25) if added else 0,
                                                  self.background_timeout_s)
        except StateUnavailable:
            pass

    async def drained_everywhere(self, rid) -> bool:
        """Whether replica ``rid``, draining here, is idle on every other live router: each has
        applied this router's ``draining`` entry (no new work goes there from it) and, in its view
        written since, has nothing in flight there. Publishes the entry first when this router has
        not yet. True when no other router is alive. Redis down (the breaker open): True (the
        others cannot learn of the drain now; a request of theirs that meets the stopped replica
        is run elsewhere, and they drop it when they read its removal); one failed call: False
        (asked again at the next poll). Never raises."""
        try:
            if self.registry.known.get(rid, {}).get("state") != "draining":
                await self.registry.push(self.app, self.background_timeout_s)
            if self.registry.known.get(rid, {}).get("state") != "draining":
                return False
            seq = self.registry.seq.get(rid, 0)
            views = await read_status(self.redis, self.keys, self.peers.ttl_s, background=True,
                                      timeout_s=self.background_timeout_s)
        except StateUnavailable:
            return not self.redis.available
        for view in views:
            entry = (view.get("replicas") or {}).get(rid) if isinstance(view, dict) else None
            if view.get("router") == self.router_id or not isinstance(entry, dict):
                continue  # this router (its own count is the caller's), or one without the replica
            if int(entry.get("registry_seq") or 0) < seq or int(entry.get("in_flight") or 0) > 0:
                return False
        return True

    async def push_registry(self) -> None:
        """Write this router's fleet changes to the registry now, not at the next sync round
        (a removal the owner of the replica stops it on). Never raises."""
        try:
            await self.registry.push(self.app, self.background_timeout_s)
        except StateUnavailable:
            pass  # the next sync round writes it

    async def publish_versions(self, core: DecisionCore, recomputed: dict | None = None,
                               folders: dict[int, str] | None = None) -> bool:
        """Publish ``core``'s versions, policy and update rotation; False if Redis is unreachable.
        ``recomputed``: replicas whose version this moves, and whether their kept streams
        recomputed their context; ``folders``: the folders this router loaded versions from
        (``VersionSync.publish``)."""
        return await self.versions.publish(core, recomputed=recomputed, folders=folders)

    def shared_folder(self, version: int) -> str | None:
        """The folder another router loaded ``version`` from, as its last publication said
        (``VersionSync.folders``); None when none did."""
        return self.versions.folders.get(version)

    async def await_marked(self, timeout_s: float = MARK_TIMEOUT_S) -> list[str]:
        """Wait until every other live router confirmed the epoch this router published last
        (applied, its streams' spans marked: ``marked:<id>``); the routers that had not within
        ``timeout_s`` (``["redis"]`` when it could not be read). A router seen alive once during
        the wait stays awaited: one stalled past its heartbeat's TTL (a long GC pause, a frozen
        VM) is reported, not dropped. Never raises."""
        epoch, deadline = self.versions.applied, time.monotonic() + timeout_s
        others: list[str] = []
        while True:
            try:
                now = time.time()
                alive = await self.redis.call(lambda c: c.zrangebyscore(self.keys.routers, now - self.peers.ttl_s, "+inf"))
                others += [r for r in alive if r != self.router_id and r not in others]
                marks = await self.redis.call(lambda c: c.mget([self.keys.marked(r) for r in others])) if others else []
            except StateUnavailable:
                if time.monotonic() >= deadline or self.redis.breaker.state == "open":
                    return ["redis"]
                await asyncio.sleep(0.02)  # one late answer: ask again while the wait lasts
                continue
            late = [r for r, m in zip(others, marks) if m is None or int(m) < epoch]
            if not late or time.monotonic() >= deadline:
                return late
            await asyncio.sleep(0.02)

    def _applied(self, epoch: int, snapshot, moved: list, recomputed: dict) -> None:
        """Another router's snapshot (``epoch``) was applied: on a replica its update left paused
        (``cache_policy.sharing.left_paused``) this router's work ends or moves at once
        (``Lifecycle.left_paused``); mark this router's kept streams on the replicas whose version
        moved (``Lifecycle.mark_new_spans``), then confirm the epoch (``marked:<id>``), which the
        updater waits for before it resumes the engine."""
        from router import keys

        life = self.app[keys.LIFECYCLE] if self.app is not None and keys.LIFECYCLE in self.app else None
        for rid, reason in snapshot.rotation if life is not None else ():
            if left_paused(reason):
                life.left_paused(rid, f"replica {rid} was left paused by another router's weight update that {reason}")
        task = asyncio.get_running_loop().create_task(self._mark(epoch, dict(snapshot.loaded), moved, recomputed))
        self._marking.add(task)
        task.add_done_callback(self._marking.discard)

    async def _mark(self, epoch: int, loaded: dict, moved: list, recomputed: dict) -> None:
        from router import keys

        try:
            life = self.app[keys.LIFECYCLE] if self.app is not None and keys.LIFECYCLE in self.app else None
            if life is not None:
                for rid in moved:
                    if loaded.get(rid) is not None:
                        await life.mark_new_spans(rid, loaded[rid], bool(recomputed.get(rid)))
            self._marked = max(self._marked, epoch)
            marked, ttl_ms = self._marked, max(1, int(self.peers.ttl_s * 1000))
            await self.redis.call(lambda c: c.set(self.keys.marked(self.router_id), marked, px=ttl_ms),
                                  timeout_s=self.background_timeout_s, background=True)
        except StateUnavailable:
            pass  # the next round confirms it (sync_round)
        except Exception as exc:  # noqa: BLE001 - a background task must not die silently
            if repr(type(exc)) not in self._logged:
                self._logged.add(repr(type(exc)))
                log.exception("marking streams for versions epoch %s failed (logged once per cause): %r", epoch, exc)

    # -- background --------------------------------------------------------------------------------

    async def start(self, app, core: DecisionCore) -> None:
        """Join: one sync round; if Redis cannot be reached, warn and run local (versions
        unconfirmed: nothing is salted with a guess) and join when it answers."""
        from router import keys

        self.app = app
        self.versions.seed = core.versions_snapshot()
        await self.sync_round()
        if self.registry.refused:  # a router started at the same time wrote first: read its entries
            await self.sync_round()
        if self.registry.conflicts:
            from replicas.config import StartupError

            clash = "; ".join(f"{rid} is {url} on router {by}" for rid, (by, url) in sorted(self.registry.conflicts.items()))
            raise StartupError(f"the shared registry at {self.redis.url} (prefix {self.keys.prefix!r}) gives this "
                               f"router's replica ids to other servers: {clash}. Routers sharing one Redis prefix must "
                               "list the same replicas.urls in the same order, and only one of them may launch replicas "
                               "(or give this fleet its own router.redis_prefix)")
        if not self.versions.confirmed:
            if self.redis.available:
                log.info("redis %s holds no versions yet; waiting for a router to publish", self.redis.url)
            else:
                log.warning("redis %s unreachable at start: serving from local state; joining when it answers",
                            self.redis.url)
            core.unconfirm_versions()
        assert keys.CORE in app

    async def run(self) -> None:
        """Sync rounds and the pub/sub listener until cancelled; survives any error (logged once per cause)."""
        if self.sync_interval_s <= 0:
            return  # switched off: pins and versions still travel with each request
        listener = asyncio.create_task(self._listen())
        seen: set[str] = set()
        try:
            while True:
                await asyncio.sleep(self.sync_interval_s)
                try:
                    await self.sync_round()
                except Exception as exc:  # noqa: BLE001 - the loop must outlive anything
                    if repr(type(exc)) not in seen:
                        seen.add(repr(type(exc)))
                        log.exception("state sync round failed (logged once per cause): %r", exc)
        finally:
            listener.cancel()
            await asyncio.gather(listener, return_exceptions=True)

    async def sync_round(self) -> None:
        """Heartbeat + shares, versions, registry, reconcile. Redis unreachable: shares go stale."""
        from router import keys

        core = self.app[keys.CORE]
        t = self.background_timeout_s
        try:
            instance, epoch = await self.redis.call(lambda c: c.mget([self.keys.instance, self.keys.versions_epoch]),
                                                    timeout_s=t, background=True)
            if await self._check_instance(instance):
                self._republish_all = True  # until it succeeds, whatever fails in between
            # the confirmed epoch rides along (its TTL is a router's), unless a marking is under way
            marked = self._marked if self._marked >= 0 and not self._marking else None
            others = await self.peers.beat(self.app, core, view_of(self.app, self.router_id, self.versions.applied,
                                                                   self.versions.confirmed, self.address,
                                                                   self.registry.seq), t, marked)
            if self.versions.pending:  # a publication of ours got no answer: ours again (wire.PUBLISH_VERSIONS)
                if await self.versions.publish(core, retry=True, timeout_s=t):
                    epoch = self.versions.applied
            if epoch is None:
                await self.versions.restore(core, bool(others))
            elif int(epoch) > self.versions.applied:
                await self.versions.fetch(core)
            self.registry.alive = set(others)
            if await self.registry.pull(self.app, t):
                self.versions.reapply(core)
            await self.registry.push(self.app, t)
            while self._unsure_claims:
                addresses, owner = self._unsure_claims[0]
                await self.registry.release_addresses(addresses, owner, 0, t)
                self._unsure_claims.pop(0)
            if self.versions.unreleased is not None and not self.versions.pending:
                await self.versions.release_lock(self.versions.unreleased, timeout_s=t)
            if self._republish_all or self._reconcile or self.pins.dirty:
                await self.pins.republish(core, everything=self._republish_all, timeout_s=4 * t)
                self._reconcile = self._republish_all = False
            self.rounds += 1
        except StateUnavailable:
            self.peers.stale(core)

    async def _check_instance(self, instance: str | None) -> bool:
        """True when Redis lost our data (restarted empty or flushed) since the last round."""
        if instance is not None and instance == self.instance:
            return False
        token = new_router_id()
        await self.redis.call(lambda c: c.set(self.keys.instance, token, nx=True), timeout_s=self.background_timeout_s, background=True)
        lost = self.instance is not None and instance != self.instance
        self.instance = await self.redis.call(lambda c: c.get(self.keys.instance), timeout_s=self.background_timeout_s, background=True)
        if lost:
            self.restarts_seen += 1
            log.warning("redis %s lost the shared state (restarted empty?): re-publishing what this router holds",
                        self.redis.url)
            self.registry.forget()
        return lost

    async def _listen(self) -> None:
        """Apply what other routers publish on the ``events`` channel; reconnects after errors."""
        from router import keys

        logged: set[str] = set()
        while True:
            pubsub = self.redis.background.pubsub()
            try:
                async with asyncio.timeout(self.background_timeout_s):
                    await pubsub.subscribe(self.keys.events)
                while True:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if message is not None and self.app is not None:
                        await self._on_message(self.app[keys.CORE], str(message["data"]))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - Redis down or hung: retry later
                if repr(type(exc)) not in logged:
                    logged.add(repr(type(exc)))
                    log.info("state events listener: %r (retrying)", exc)
                await asyncio.sleep(max(0.5, 2 * self.sync_interval_s))
            finally:
                try:
                    async with asyncio.timeout(0.5):
                        await pubsub.aclose()
                except Exception:  # noqa: BLE001
                    pass

    async def _on_message(self, core: DecisionCore, data: str) -> None:
        from router import keys

        kind, fields = parse_event(data)
        try:
            if kind == "pin":
                if self.pins.on_event(core, fields) and keys.LIFECYCLE in self.app:
                    self.app[keys.LIFECYCLE].pump()  # its parked prefix no longer holds room
            elif kind == "versions" and fields and int(fields[0]) > self.versions.applied:
                await self.versions.fetch(core)
            elif kind == "replicas" and await self.registry.pull(self.app, self.background_timeout_s):
                self.versions.reapply(core)
        except StateUnavailable:
            pass

    def _on_back(self) -> None:
        self._reconcile = True

    def _changed(self) -> None:
        from router import keys

        if self.app is not None and keys.LIFECYCLE in self.app:
            self.app[keys.LIFECYCLE].rotation_changed()

    async def close(self) -> None:
        """Leave (heartbeat and share removed, bounded) and close the connections."""
        try:
            await self.peers.leave()
        except StateUnavailable:
            pass
        await self.redis.close()

    def describe(self) -> dict:
        """For /health and status: redis reachability, breaker, epoch, counters."""
        return {"kind": "redis", "router": self.router_id, "available": self.available,
                "breaker": self.redis.breaker.state, "epoch": self.versions.applied,
                "versions_confirmed": self.versions.confirmed, "pins_moved_to_winner": self.pins.moved,
                "pins_pending": len(self.pins.dirty), "sync_rounds": self.rounds, "time": time.time()}
