"""Weight versions and the update lock across routers (issue 13, DESIGN rules 4 and 7).

The router that runs a weight update publishes the core's version snapshot
(``DecisionCore.versions_snapshot``) after each step; each publication gets the next *epoch*.
Every router reads the epoch with the pins of each request, before ``core.open`` chooses the
request's salt (one MGET), and applies a newer snapshot first. So a router never salts new work
for a replica with a version older than the last one published, and replicas an update holds
out of rotation are out of rotation everywhere before the update touches them (the updater
publishes before pausing; if it cannot, it does not proceed: see /work/helpers/STATE-API.md).

When Redis cannot be reached no update can start (the lock needs Redis), so the last snapshot
a router confirmed stays right; a router that has never confirmed one (started while Redis was
down) salts nothing with a guess (``DecisionCore.unconfirm_versions``) until it can.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable
from typing import Any

from cache_policy.core import DecisionCore
from cache_policy.sharing import VersionSnapshot
from router.state.redis_client import GuardedRedis, StateUnavailable
from router.state.wire import PUBLISH_VERSIONS, REFRESH_LOCK, RELEASE_LOCK, Keys

log = logging.getLogger(__name__)


class VersionSync:
    """Version snapshots and the weight-update lock in Redis.

    ``applied``: epoch of the snapshot this router's core agrees with (-1: none confirmed;
    ``confirmed`` is False until one is, or until this router seeded a fresh Redis).
    """

    def __init__(self, redis: GuardedRedis, keys: Keys, router_id: str, on_change: Callable[[], None],
                 on_applied: Callable[[int, VersionSnapshot, list, dict], None] = lambda *_: None) -> None:
        self.redis, self.keys, self.router_id, self.on_change = redis, keys, router_id, on_change
        self.on_applied = on_applied
        """Called with ``(epoch, snapshot, replicas whose version moved, {replica: recomputed})``
        after another router's snapshot was applied (``RedisState`` marks streams' spans, then
        confirms the epoch)."""
        self.applied = -1
        self.confirmed = False
        self.seed: VersionSnapshot | None = None
        """The configured versions, published if Redis holds none and no other router is alive."""
        self.missing = False
        """Redis holds no snapshot although this router has one (restarted empty): re-publish."""
        self.last: VersionSnapshot | None = None
        """The newest snapshot this router applied from Redis or published itself (re-applied to
        replicas the registry adds later)."""
        self.unreleased: str | None = None
        """The owner of an update lock this router could not release (sent again by the sync round)."""
        self.control_timeout_s: float | None = None
        """The deadline of the weight-update path's calls (the lock, publications, the snapshot read
        at the lock), longer than a request's (``router.redis_timeout_s``, 75 ms by default): an
        update is rare and may wait, and a fresh attacker saw one in three updates fail on a single
        late answer on a loaded 2-core host (a replica left on the old version, a 409 naming no
        holder). None: the client's default."""
        self.folders: dict[int, str] = {}
        """Per version still served somewhere (or current), the folder a router loaded it from, as
        publications carried them (``publish``'s ``folders``): another router's refused commit or
        failed load restores the previous weights from it instead of leaving them undefined."""
        self.pending = False
        """A publication of this router's got no answer (Redis down, or slow: it may have been
        written): the core's snapshot is published again by the next sync round (:meth:`publish`
        with ``retry``), so no router keeps a rotation or version this one took back."""

    def reapply(self, core: DecisionCore) -> None:
        """Replicas joined (registry): give them the versions of the last snapshot applied or
        published. Not while a publication is pending: ``last`` is older than the core then, and
        applying it would take back what this router changed since (an update's hold undone)."""
        if self.last is not None and not self.pending:
            core.apply_versions(self.last)

    async def observe(self, core: DecisionCore, raw_epoch: str | None) -> None:
        """A read returned the epoch ``raw_epoch``: apply a newer snapshot. Never raises."""
        if raw_epoch is None:
            self.missing = self.applied >= 0
            return
        if int(raw_epoch) > self.applied:
            try:
                await self.fetch(core)
            except StateUnavailable:  # a newer snapshot exists and could not be read: ours is stale
                if self.confirmed:
                    log.warning("versions epoch %s published but unreadable: not salting until confirmed", raw_epoch)
                self.confirmed = False
                core.unconfirm_versions()
                self.on_change()

    async def fetch(self, core: DecisionCore, timeout_s: float | None = None) -> bool:
        """Read and apply the snapshot in Redis if newer; True when Redis holds one.
        Raises StateUnavailable."""
        raw = await self.redis.call(lambda c: c.hgetall(self.keys.versions), timeout_s=timeout_s)
        if not raw or "snapshot" not in raw:
            self.missing = self.applied >= 0
            return False
        epoch = int(raw["epoch"])
        if epoch > self.applied and raw.get("by") == self.router_id:
            # our own publication, whose answer was lost: the core holds it or newer (applying it
            # would take back what changed since: a hold undone, a version loaded since)
            self.applied, self.confirmed, self.missing = epoch, True, False
            return True
        if epoch > self.applied:
            try:
                data = json.loads(raw["snapshot"])
                snapshot = VersionSnapshot.from_json(data)
                changed = core.apply_versions(snapshot)
                self._merge_folders(data.get("folders"), snapshot)
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("ignoring a malformed version snapshot (epoch %s, by %s): %r", epoch, raw.get("by"), exc)
                return True
            was = self.confirmed
            self.applied, self.confirmed, self.missing, self.last = epoch, True, False, snapshot
            if changed or not was:
                log.info("versions from %s (epoch %d): current %s, changed %s", raw.get("by"), epoch,
                         core.versions.current, changed)
            self.on_change()
            self.on_applied(epoch, snapshot, changed, _recomputed(raw.get("recomputed")))
        return True

    def _merge_folders(self, folders: Any, snapshot: VersionSnapshot) -> None:
        """Take the folders a publication carried (``{"version": "path"}``; anything else is
        ignored) and keep those of versions ``snapshot`` still has served or current (bounded by
        the replicas, whatever the number of updates)."""
        if isinstance(folders, dict):
            for version, path in folders.items():
                with contextlib.suppress(TypeError, ValueError):
                    if isinstance(path, str) and path:
                        self.folders[int(version)] = path
        live = _live_versions(snapshot)
        for version in [v for v in self.folders if v not in live]:
            del self.folders[version]

    async def publish(self, core: DecisionCore, *, retry: bool = False, timeout_s: float | None = None,
                      recomputed: dict | None = None, folders: dict[int, str] | None = None) -> bool:
        """Publish the core's snapshot as the next epoch (past Redis's and this router's own,
        ``PUBLISH_VERSIONS``); False when Redis is unreachable or did not answer in time (then
        :attr:`pending`: the sync round publishes again). ``retry``: that publication again, not
        written over a newer one of another router (False then, and nothing pending).
        ``recomputed``: replicas whose version this publication moves, and whether their kept
        streams recomputed their context (the other routers' new spans say so). ``folders``: the
        folders this router loaded versions from; those of versions served or current go along."""
        snapshot = core.versions_snapshot()
        data = snapshot.as_json()
        if folders:
            live = _live_versions(snapshot)
            data["folders"] = {str(v): p for v, p in folders.items() if v in live}
        text = json.dumps(data)
        try:
            epoch, written = await self.redis.call(
                lambda c: c.eval(PUBLISH_VERSIONS, 2, self.keys.versions, self.keys.versions_epoch, text,
                                 self.router_id, self.keys.events, "", self.applied, "1" if retry else "",
                                 json.dumps(recomputed or {})),
                timeout_s=timeout_s or self.control_timeout_s, background=retry)
        except StateUnavailable as exc:
            if not self.pending:
                log.warning("could not publish versions (published again once redis answers): %s", exc)
            self.pending = True
            return False
        self.pending = False
        if not int(written):  # another router published since: its snapshot is fetched and applied
            log.warning("versions not published again: another router published epoch %s since", epoch)
            return False
        self.applied, self.confirmed, self.missing, self.last = int(epoch), True, False, snapshot
        self._merge_folders(data.get("folders"), snapshot)
        return True

    async def restore(self, core: DecisionCore, others_alive: bool) -> None:
        """Redis holds no snapshot: re-publish ours under its epoch (restarted empty), or, on a
        fresh Redis with no other router alive, seed the configured versions. Raises StateUnavailable."""
        if self.applied >= 0:
            snapshot, epoch = core.versions_snapshot(), self.applied
        elif not others_alive and self.seed is not None:
            snapshot, epoch = self.seed, 0
        else:
            return  # a router that holds a view will re-publish it; then we apply it
        result, written = await self.redis.call(
            lambda c: c.eval(PUBLISH_VERSIONS, 2, self.keys.versions, self.keys.versions_epoch,
                             json.dumps(snapshot.as_json()), self.router_id, self.keys.events, str(epoch), "", "", ""))
        if int(written):
            if not self.confirmed:
                core.apply_versions(snapshot)
                self.on_change()
            self.applied, self.confirmed, self.missing, self.last = epoch, True, False, snapshot
            log.warning("re-published versions (epoch %d) to an empty redis", epoch)

    # -- the weight-update lock ------------------------------------------------------------------

    async def acquire_lock(self, owner: str, ttl_s: float, core: DecisionCore | None = None) -> bool:
        """SET NX PX: True when ``owner`` holds the lock now. False if held by another or Redis is down.

        With ``core``: once the lock is held the newest snapshot is read and applied (:meth:`fetch`),
        so the update begins from where the last one ended; this router's sync round may not have
        read that yet, and its first publication, from the older view, would put the last update's
        replicas back to "updating" with nothing left to clear it. The lock goes back when the
        read fails."""
        try:
            if not await self.redis.call(lambda c: c.set(self.keys.lock_update, owner, nx=True,
                                                          px=max(1, int(ttl_s * 1000))),
                                         timeout_s=self.control_timeout_s):
                return False
            if core is not None:
                await self.fetch(core, self.control_timeout_s)
            return True
        except StateUnavailable:
            await self.release_lock(owner, now=True)
            return False

    async def refresh_lock(self, owner: str, ttl_s: float) -> bool:
        """Extend ``owner``'s lock by ``ttl_s``; False if it no longer holds it or Redis is down."""
        try:
            return bool(await self.redis.call(lambda c: c.eval(REFRESH_LOCK, 1, self.keys.lock_update, owner,
                                                               max(1, int(ttl_s * 1000))),
                                              timeout_s=self.control_timeout_s))
        except StateUnavailable:
            return False

    async def release_lock(self, owner: str, *, timeout_s: float | None = None, now: bool = False) -> None:
        """Delete the lock if ``owner`` holds it. Never raises: when Redis cannot be reached the
        release is kept (:attr:`unreleased`) and the sync round sends it again, or every router's
        next update would wait out the lock's TTL (60 s after a blink of under a second).

        While a publication of this router is :attr:`pending` (an update's last snapshot without
        an answer) the release waits for it, unless ``now``: the lock keeps any other router from
        beginning an update, and publishing, from a snapshot without this one's last (its replicas
        left "updating" for good, every request refused there). The sync round sends the
        publication first, then the release."""
        if self.pending and not now:
            if self.unreleased != owner:
                log.warning("update lock of %s kept until this router's last snapshot is published", owner)
            self.unreleased = owner
            return
        try:
            await self.redis.call(lambda c: c.eval(RELEASE_LOCK, 1, self.keys.lock_update, owner),
                                  timeout_s=timeout_s or self.control_timeout_s, background=timeout_s is not None)
        except StateUnavailable as exc:
            if self.unreleased != owner:
                log.warning("could not release the update lock of %s (released again once redis answers): %s",
                            owner, exc)
            self.unreleased = owner
            return
        if self.unreleased == owner:
            self.unreleased = None

    async def lock_holder(self) -> str | None:
        """Who holds the update lock (None: free, or Redis unreachable)."""
        try:
            return await self.redis.call(lambda c: c.get(self.keys.lock_update), timeout_s=self.control_timeout_s)
        except StateUnavailable:
            return None


def _recomputed(raw: str | None) -> dict[str, bool]:
    """The ``recomputed`` field of a published snapshot (empty when absent or malformed)."""
    try:
        value = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return {str(k): bool(v) for k, v in value.items()} if isinstance(value, dict) else {}


def _live_versions(snapshot: VersionSnapshot) -> set[int | None]:
    """The versions ``snapshot`` has served somewhere, and its current one: those whose folders
    publications carry (:meth:`VersionSync.publish`) and routers keep (``VersionSync.folders``)."""
    return {v for _, v in snapshot.loaded if v is not None} | {snapshot.current}
