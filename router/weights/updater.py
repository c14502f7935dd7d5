"""One weight update at a time over the router's replicas, owned by the app (issue 10).

Every operation (folder update, begin, commit, abort) runs as a task the updater owns; the HTTP
handler awaits it shielded, so a trainer whose client times out or disconnects cancels only its
wait: the update runs to its end or rolls back, and the same call made again (same version)
joins it or returns its report (idempotent by version). A two-phase update not committed within
``commit_timeout_s`` is aborted by the router. Across routers the update holds the shared update
lock (``router.state``: ``acquire_update_lock``), refreshed while it runs, and publishes versions
and rotation after each replica step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import Any, Awaitable, Callable, Mapping

from cache_policy.sharing import left_paused
from cache_policy.types import ReplicaId
from router.errors import NoReplica
from router.lifecycle import Lifecycle
from router.weights.requests import UpdateRequest
from router.weights.steps import SETTLED_PAUSE_TIMEOUT_S, ReplicaUpdate, Steps
from router.weights.update import LOCK_TTL_S, Update, UpdateInProgress, VersionConflict

log = logging.getLogger(__name__)

CATCH_UP_RETRY_S = 1.0
"""How long a catch-up waits before trying again when another router's update holds the lock."""
CATCH_UP_TRIES = 600
"""Attempts of one catch-up (each after an update in progress ended, or the retry wait)."""
CATCH_UP_DRAIN_S = 60.0
"""The catch-up's drain: the replica is fresh and out of rotation, so nothing should be there."""
REVIVE_TIMEOUT_S = 5.0
"""How long one resume of a replica whose engine hung at an update waits for its answer."""


class WeightUpdater:
    """Runs weight updates for one router app (``router.admin`` handlers call it).

    ``initial_path``: the folder replicas start from, if known."""

    def __init__(self, life: Lifecycle, initial_path: str | None = None) -> None:
        self.life, self.core = life, life.core
        self.steps = Steps(life, initial_path)
        self.folders = self.steps.folders
        self.active: Update | None = None
        self.last: Update | None = None
        self._tasks: set[asyncio.Task] = set()
        self._reviving: dict[ReplicaId, asyncio.Task] = {}
        """Replicas of ``Steps.hung`` whose resume is being tried now (:meth:`_revive`): an update
        holds one only once that resume is answered or timed out (:meth:`_hold`), so the resume
        never lands after the update's pause."""
        self._owner: str | None = None
        self.restart_engine: Callable[[ReplicaId, str], bool] | None = None
        """Restart a replica this router launched whose engine hangs (``ReplicaSet.engine_stalled``:
        True when a restart began); None without a replica set. Asked when an update's pause got
        no answer (``ReplicaUpdate.engine_hung``): the replica would otherwise stay out, failed,
        with no stall rule or probe to find it (a fresh attacker's update waited 600 s on one)."""

    # -- the calls ------------------------------------------------------------------------------

    async def update(self, req: UpdateRequest) -> dict[str, Any]:
        """Folder form: hold, settle, load, commit each target (rolling or all at once).
        VersionConflict (409) for a version the fleet has from another folder or under another
        policy (:meth:`_conflict`)."""
        active = self.active
        if active is not None and active.kind == "folder" and active.req == req and active.task is not None:
            return await self._join(active.task)  # the same call again (a client that timed out): join it
        self._conflict(req)
        last = self.last
        if last is not None and last.kind == "folder" and last.req.version == req.version and not self._targets(req):
            return self.report(last)  # the same version again, done already: the report of the update that loaded it
        upd = await self._start(req, "folder")
        upd.task = self._spawn(self._folder(upd))
        return await self._join(upd.task)

    def _conflict(self, req: UpdateRequest) -> None:
        """Raise VersionConflict when ``req`` (folder form) names a version the fleet already
        loaded from another checkpoint folder (two sets of weights would answer as one version:
        a retry of a partly failed update loading another folder on the rest, or a repeat that
        said ok and loaded nothing), or the current version under another policy (a repeat of a
        finished update, its policy left to the default, switched the fleet's salting)."""
        known = self.steps.folder_of_version(req.version)
        if known is not None and req.weights_path is not None and not _same_folder(known, req.weights_path):
            raise VersionConflict(f"version {req.version} was loaded from {known!r}, not {req.weights_path!r}: "
                                  "one version is one set of weights; give a new checkpoint a new version",
                                  param="weights_path")
        versions = self.core.versions
        if req.version == versions.current and req.policy != versions.policy:
            raise VersionConflict(f"version {req.version} is the fleet's already, under policy {versions.policy!r}, "
                                  f"not {req.policy!r}: repeat the call with the same policy (it says so "
                                  "and loads nothing new), or load the next version under the new one",
                                  param="policy")

    async def begin(self, req: UpdateRequest) -> dict[str, Any]:
        """Two-phase: hold and settle every target; the report says which are ready for weights."""
        active = self.active
        if active is not None and active.kind == "push" and active.req.version == req.version:
            return await self._join(active.task) if active.task is not None else self.report(active)
        upd = await self._start(req, "push")
        upd.task = self._spawn(self._begin(upd))
        return await self._join(upd.task)

    async def commit(self, version: int, weights_path: str | None) -> dict[str, Any]:
        """Two-phase: the trainer pushed ``version``: apply the policy, record it, resume."""
        upd = await self._named(version, "commit")
        if upd.phase in ("done", "aborted", "committing") or upd is not self.active:
            return await self._join(upd.task) if upd.task is not None and not upd.task.done() else self.report(upd)
        if upd.phase != "ready":
            raise UpdateInProgress(f"update {version} is {upd.phase}; commit once begin has answered")
        upd.phase = "committing"
        upd.task = self._spawn(self._finish(upd, lambda rid, rec: self.steps.commit(
            rid, rec, version, upd.req.policy, upd.req.preempt_running, transfer=upd.req.transfer == "vllm",
            new_path=weights_path), "done"))
        return await self._join(upd.task)

    async def abort(self, version: int, restore: bool) -> dict[str, Any]:
        """Two-phase: resume every target on its previous weights (reloaded first when ``restore``)."""
        upd = await self._named(version, "abort")
        if upd is not self.active or upd.phase in ("committing", "aborting"):
            return await self._join(upd.task) if upd.task is not None and not upd.task.done() else self.report(upd)
        if upd.task is not None and not upd.task.done():
            await self._join(upd.task)  # begin still settling: abort when it has
        upd.phase = "aborting"
        upd.task = self._spawn(self._finish(upd, lambda rid, rec: self.steps.release(rid, rec, restore), "aborted"))
        return await self._join(upd.task)

    def rejoined(self, rid: ReplicaId, why: str = "after its (re)start") -> None:
        """``rid`` was launched, or restarted, from the replicas' model: it serves the initial
        version (``DecisionCore.restarted`` records it so; a restart after an update used to keep
        the version it had, so its answers named weights it no longer served). While the fleet
        serves a later version, it stays out of rotation and is brought to that version in the
        background (:meth:`catch_up`). ``why``: how it came to serve an older version, for the
        rotation reason (also :meth:`catch_up_recovered`)."""
        self.steps.missed.discard(rid)
        versions = self.core.versions
        if rid in self.core.replicas and versions.loaded.get(rid) != versions.current:
            loaded = versions.loaded.get(rid)
            reason = (f"catching up: serves {'unknown weights' if loaded is None else f'version {loaded}'} {why}, "
                      f"the fleet serves {versions.current}")
            self.core.set_rotation(rid, reason)
            self.life.rotation_changed()
            self._spawn(self.steps.publish())  # the other routers hold it out too
            self._spawn(self.catch_up(rid, reason))

    def catch_up_recovered(self, now: float) -> None:
        """Replicas an update passed by while their engine was stalled (``Steps.missed``) that
        are back in service at ``now`` (a token moved, or a probe was answered): brought to the
        fleet's version as a restarted one is (:meth:`rejoined`), before they take work again
        (the scrape loop asks each round). Never raises."""
        for rid in list(self.steps.missed):
            rec = self.core.replicas.get(rid)
            if rec is None:
                self.steps.missed.discard(rid)
            elif rec.healthy and not self.core.stalled(rid, now) and rid not in self.core.versions.rotation:
                self.rejoined(rid, "since an update passed it by while its engine was stalled")
        for rid in list(self.steps.hung):
            if rid not in self.core.replicas or not left_paused(self.core.versions.rotation.get(rid)):
                self.steps.hung.discard(rid)  # it left, or an update took it along
            elif rid not in self._reviving and self.active is None:
                self._reviving[rid] = self._spawn(self._revive(rid))

    async def hold_paused(self, rids: list[ReplicaId] | None = None) -> list[ReplicaId]:
        """Those of ``rids`` (default: every replica) whose engine is paused (``GET /is_paused``,
        all at once, 5 s each), asked as this router starts and as a server is registered: an
        update run by a router since stopped may have left them so, their weights undefined, and
        only its memory knew (with shared state its publication says so, and is applied after
        this). Each stays out of rotation, its version unknown, until an update through this
        router takes it along (a replica out of rotation is a target): requests sent there waited
        for the stall rule or ``router.request_timeout_s``. Returns them."""
        rids = list(self.core.replicas) if rids is None else [rid for rid in rids if rid in self.core.replicas]
        answers = await asyncio.gather(*(self.steps.control(rid).is_paused() for rid in rids), return_exceptions=True)
        paused = [rid for rid, answer in zip(rids, answers) if answer is True]
        for rid in paused:
            log.warning("replica %s: its engine is paused as this router takes it; out of rotation until an update "
                        "through this router takes it along", rid)
            self.core.version_loaded(rid, None)
            self.core.set_rotation(rid, "failed: its engine was paused when this router took it (an update run "
                                        "elsewhere may have left it so, its weights unknown); the next update "
                                        "takes it along")
        if paused:
            self.life.rotation_changed()
        return paused

    async def _revive(self, rid: ReplicaId) -> None:
        """Resume ``rid``, which an update left paused when its pause got no answer, if its engine
        answers now (at most :data:`REVIVE_TIMEOUT_S`; else the next scrape round asks again); then
        back in rotation on the weights it kept (nothing was loaded), or brought to the fleet's
        version first (:meth:`rejoined`). Never raises."""
        try:
            if await self.steps.control(rid).resume(attempts=1, timeout_s=REVIVE_TIMEOUT_S) is not None:
                return
            if rid not in self.steps.hung or self.active is not None:
                return  # an update began meanwhile: it takes the replica along
            self.steps.hung.discard(rid)
            log.warning("replica %s: its engine answered again after hanging at a weight update: resumed", rid)
            if self.core.versions.loaded.get(rid) == self.core.versions.current:
                self.core.set_rotation(rid, None)
                self.life.rotation_changed()
                await self.steps.publish()
            else:  # out of rotation until then ("catching up")
                self.rejoined(rid, "after its engine hung at an update")
        except Exception as exc:  # noqa: BLE001 - a background task says why; the next round tries again
            log.warning("replica %s: resuming it after its engine hung failed: %r", rid, exc)
        finally:
            self._reviving.pop(rid, None)

    async def catch_up(self, rid: ReplicaId, reason: str) -> None:
        """Bring ``rid`` to the fleet's current version: a one-replica folder update (hold,
        drain, pause, load, the policy in force, resume) from the folder that version was loaded
        from, by this router or another (``Steps.folder_of_version``), once no update runs. With
        no such folder (the version was pushed, two-phase without ``weights_path``) it
        stays out of rotation, the reason saying so, until the next update, which takes it along
        (a replica out of rotation is a target). A failed load leaves it out too. It gives up
        once ``rid`` is no longer out for ``reason`` (an update took it along, or it left).
        Never raises."""
        for _ in range(CATCH_UP_TRIES):
            versions = self.core.versions
            current = versions.current
            if versions.rotation.get(rid) != reason or versions.loaded.get(rid) == current:
                return
            if self.active is not None:
                await self.active.ended.wait()
                continue
            path = self.steps.folder_of_version(current)
            if path is None:
                return self._leave_out(rid, f"serves version {versions.loaded.get(rid)}, not the fleet's; version "
                                            f"{current} was pushed without a folder: the next "
                                            "update brings it along")
            log.info("replica %s %s: loading version %s from %s", rid, reason, current, path)
            req = UpdateRequest(current, path, versions.policy, "rolling", "wait", False, (rid,),
                                drain_timeout_s=CATCH_UP_DRAIN_S)
            try:
                report = await self.update(req)
            except UpdateInProgress:  # another router's update holds the lock: it may take this one along
                await asyncio.sleep(CATCH_UP_RETRY_S)
                continue
            except Exception as exc:  # noqa: BLE001 - a background task says why, and leaves it out
                return self._leave_out(rid, f"catching up to version {current} failed: {exc!r}")
            if not report["ok"]:
                errors = "; ".join(r["error"] or "" for r in report["replicas"])
                return self._leave_out(rid, f"catching up to version {current} failed: {errors}")
            # out of rotation since its start, it ran nothing: its cache holds the new version's KV only
            self.core.cache_reset(rid)
            return
        self._leave_out(rid, f"catching up to version {self.core.versions.current} gave up after {CATCH_UP_TRIES} tries")

    def _leave_out(self, rid: ReplicaId, reason: str) -> None:
        log.warning("replica %s out of rotation: %s", rid, reason)
        if rid in self.core.replicas:
            self.core.set_rotation(rid, reason)
            self.life.rotation_changed()
            self._spawn(self.steps.publish())

    def report(self, upd: Update) -> dict[str, Any]:
        return upd.report(self.core.versions.describe())

    def describe(self, out: Mapping[ReplicaId, str] | None = None) -> dict[str, Any]:
        """``GET /admin/weights``: versions, rotation, health and each replica's update phase
        (outside an update: ``serving``; ``unhealthy``, in rotation but not routed to: its scrapes
        or requests failed, or its engine stalled; ``out`` of rotation). ``out``: the replicas out
        of rotation, with why, as ``GET /admin/replicas`` lists them (``router.fleet.out_of_rotation``:
        also those being restarted; a fresh attacker saw a dead replica shown ``serving``, in
        rotation, for its whole restart); default: the core's rotation alone."""
        state = self.core.versions.describe()
        active = self.active
        for rid, rep in state["replicas"].items():
            if out is not None:
                rep["in_rotation"], rep["out_of_rotation_reason"] = rid not in out, out.get(rid)
            replica = self.core.replicas.get(rid)
            rep["healthy"] = replica is not None and replica.healthy
            rec = active.replicas.get(rid) if active is not None else None
            rep["phase"] = (rec.phase if rec is not None else "out" if not rep["in_rotation"]
                            else "serving" if rep["healthy"] else "unhealthy")
        return {**state, "update": self.report(active) if active is not None else None,
                "last_update": self.report(self.last) if self.last is not None else None}

    async def close(self) -> None:
        """App shutdown: let running updates end (each step is bounded by its own timeouts); a
        two-phase update still waiting for its trainer is aborted (restored)."""
        active = self.active
        if active is not None and active.kind == "push":
            with contextlib.suppress(Exception):
                await self.abort(active.req.version, restore=True)
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- runs -----------------------------------------------------------------------------------

    async def _folder(self, upd: Update) -> dict[str, Any]:
        try:
            targets = list(upd.replicas)
            if upd.req.mode == "all":
                await asyncio.gather(*(self._hold(rid, upd) for rid in targets))
                await asyncio.gather(*(self._one(rid, upd, held=True) for rid in targets))
            else:
                failed: ReplicaId | None = None
                for rid in targets:
                    if failed is not None:
                        self.steps.skip(rid, upd.replicas[rid], failed, upd.req.weights_path or "", upd.req.pause_mode)
                        continue
                    await self._one(rid, upd)
                    failed = rid if upd.replicas[rid].load_failed else None
            if not targets:
                self.core.finish_update(upd.req.version, upd.req.policy)  # type: ignore[arg-type]
            upd.phase = "done"
            return self._final_report(upd)
        finally:
            await self._end(upd)

    async def _one(self, rid: ReplicaId, upd: Update, held: bool = False) -> None:
        rec, req = upd.replicas[rid], upd.req
        try:
            if not held and not await self._hold(rid, upd):
                return
            if rec.phase == "failed":
                return
            if not await self.steps.settle(rid, rec, req.pause_mode, req.drain_timeout_s):
                await self.steps.release(rid, rec, restore=False)
                return self._restart_if_hung(rid, rec)
            if await self.steps.load(rid, rec, req.weights_path or ""):
                await self.steps.commit(rid, rec, req.version, req.policy, req.preempt_running,
                                        new_path=req.weights_path)
            else:
                await self.steps.release(rid, rec, restore=False)  # previous (restored) or undefined
        except Exception as exc:  # noqa: BLE001 - a bug must not leave the replica paused or out
            await self._rescue(rid, rec, exc)

    def _restart_if_hung(self, rid: ReplicaId, rec: ReplicaUpdate) -> None:
        """``rid``'s pause got no answer: restart it when this router launched it (the restart
        brings it back on the model, then :meth:`rejoined` catches it up); else (a server given by
        URL) it stays out, failed, until its engine answers a resume (:meth:`catch_up_recovered`
        asks each scrape round), the next update takes it along, or its operator restarts it."""
        if not rec.engine_hung:
            return
        if self.restart_engine is not None and self.restart_engine(
                rid, f"its engine did not answer a weight update's pause within {SETTLED_PAUSE_TIMEOUT_S:g} s (hung)"):
            rec.note("restarting it (launched by this router); it is brought to the fleet's version after")
            log.warning("replica %s: its engine did not answer the update's pause: restarting it", rid)
            return
        self.steps.hung.add(rid)
        rec.note("resumed (and brought to the fleet's version) once its engine answers again")

    async def _hold(self, rid: ReplicaId, upd: Update) -> bool:
        reviving = self._reviving.get(rid)
        if reviving is not None:  # its resume first (bounded by its own timeout), then this update's pause
            await asyncio.wait({reviving}, timeout=REVIVE_TIMEOUT_S + 1)
        return await self.steps.hold(rid, upd.replicas[rid])

    async def _begin(self, upd: Update) -> dict[str, Any]:
        req = upd.req
        try:
            held = [rid for rid in upd.replicas if await self._hold(rid, upd)]

            async def settle(rid: ReplicaId) -> None:
                rec = upd.replicas[rid]
                try:
                    if not await self.steps.settle(rid, rec, req.pause_mode, req.drain_timeout_s,
                                                   transfer=req.transfer == "vllm"):
                        await self.steps.release(rid, rec, restore=False)
                        self._restart_if_hung(rid, rec)
                except Exception as exc:  # noqa: BLE001
                    await self._rescue(rid, rec, exc)
            await asyncio.gather(*(settle(rid) for rid in held))
        except BaseException:
            await self._end(upd)
            raise
        if not any(r.phase == "paused" for r in upd.replicas.values()):
            upd.phase = "aborted"
            await self._end(upd)
        else:
            upd.phase, upd.ready_at = "ready", time.monotonic()
        return self.report(upd)

    async def _finish(self, upd: Update, step, phase: str) -> dict[str, Any]:
        try:
            async def one(rid: ReplicaId, rec: ReplicaUpdate) -> None:
                try:
                    await step(rid, rec)
                except Exception as exc:  # noqa: BLE001
                    await self._rescue(rid, rec, exc)
            await asyncio.gather(*(one(rid, rec) for rid, rec in upd.replicas.items() if rec.phase == "paused"))
            upd.phase = phase
            return self._final_report(upd)
        finally:
            await self._end(upd)

    async def _keeper(self, upd: Update) -> None:
        """While ``upd`` runs: refresh the shared lock; abort a two-phase update whose trainer did
        not commit within ``commit_timeout_s`` of the targets being ready."""
        while not upd.ended.is_set():
            wait = LOCK_TTL_S / 3 if upd.phase != "beginning" else 0.25  # look again once it is ready
            if upd.phase == "ready" and upd.ready_at is not None:
                left = upd.ready_at + upd.req.commit_timeout_s - time.monotonic()
                if left <= 0:
                    log.warning("weight update %s not committed within %s s: aborting it", upd.req.version,
                                upd.req.commit_timeout_s)
                    with contextlib.suppress(Exception):
                        await self.abort(upd.req.version, restore=True)
                    return
                wait = min(wait, left)
            try:
                await self._refresh()
            except Exception as exc:  # noqa: BLE001 - the keeper outlives a bad peer
                log.warning("refreshing the update lock failed: %r", exc)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(upd.ended.wait(), max(0.05, wait))

    async def _rescue(self, rid: ReplicaId, rec: ReplicaUpdate, exc: Exception) -> None:
        log.exception("weight update of %s failed unexpectedly: %r", rid, exc)
        rec.note(f"unexpected error: {exc!r}")
        if rec.phase == "loading":
            rec.weights = "undefined"  # the load may have begun: unknown weights stay out
        with contextlib.suppress(Exception):
            await self.steps.release(rid, rec, restore=False)

    # -- one at a time --------------------------------------------------------------------------

    async def _start(self, req: UpdateRequest, kind: str) -> Update:
        if self.active is not None:
            raise UpdateInProgress(f"weight update {self.active.req.version} ({self.active.kind}) is "
                                   f"{self.active.phase}; retry when it has finished")
        targets = self._targets(req)
        upd = Update(req, kind, {rid: ReplicaUpdate(rid) for rid in targets})
        self.active = upd  # before any await: a second call sees it
        shared = self.life.shared
        if shared is not None:
            self._owner = f"{getattr(shared, 'router_id', 'router')}:{req.version}"
            if not await self._acquire(shared):
                self.active, self._owner = None, None
                if not getattr(shared, "available", True):
                    raise NoReplica("shared state unreachable: no update can be coordinated across routers",
                                    headers={"Retry-After": "5"})
                holder = await shared.update_lock_holder()
                if holder is None:  # free now, or unreadable: nobody to name
                    raise NoReplica("the weight-update lock could not be taken (Redis answered too late, or another "
                                    "router's update ended just then); retry", headers={"Retry-After": "1"})
                raise UpdateInProgress(f"another router's weight update holds the lock ({holder}); retry later")
        self._spawn(self._keeper(upd))
        return upd

    async def _acquire(self, shared) -> bool:
        """Take the update lock; a lock this router holds with no update of its own running (its
        release was lost) is released and taken again."""
        if await shared.acquire_update_lock(self._owner, LOCK_TTL_S):
            return True
        holder = await shared.update_lock_holder()
        mine = f"{getattr(shared, 'router_id', 'router')}:"
        if holder is None or not holder.startswith(mine):
            return False
        log.warning("update lock %s is this router's own from an update that has ended: taken back", holder)
        await shared.release_update_lock(holder, now=True)  # what it waited for, this update publishes anew
        return await shared.acquire_update_lock(self._owner, LOCK_TTL_S)

    async def _refresh(self) -> None:
        shared = self.life.shared
        if shared is not None and self._owner is not None:
            await shared.refresh_update_lock(self._owner, LOCK_TTL_S)

    def _final_report(self, upd: Update) -> dict[str, Any]:
        """``upd``'s report as it ended: its duration fixed now, so a repeated commit (or abort)
        answers the very same report (the CI once saw 0.705 then 0.704 s)."""
        upd.seconds = time.monotonic() - upd.started
        return self.report(upd)

    async def _end(self, upd: Update) -> None:
        upd.seconds = upd.seconds or time.monotonic() - upd.started
        upd.ended.set()
        if self.active is upd:
            self.active, self.last = None, upd
            await self.steps.publish()
            shared, owner, self._owner = self.life.shared, self._owner, None
            if shared is not None and owner is not None:
                await shared.release_update_lock(owner)

    async def _named(self, version: int, what: str) -> Update:
        """The two-phase update of ``version`` this router began; UpdateInProgress (409) otherwise,
        naming the router that began it when another one did (a router runs the updates it began)."""
        for upd in (self.active, self.last):
            if upd is not None and upd.kind == "push" and upd.req.version == version:
                return upd
        shared = self.life.shared
        holder = await shared.update_lock_holder() if shared is not None else None
        if holder is not None and holder.endswith(f":{version}"):
            began = holder.rsplit(":", 1)[0]
            address = await shared.address_of(began) if hasattr(shared, "address_of") else None
            raise UpdateInProgress(f"the update of version {version} was begun on router {began}"
                                   f"{f' at {address}' if address else ''}: {what} it there "
                                   f"(a router runs the updates it began)")
        raise UpdateInProgress(f"no two-phase update of version {version} to {what}; POST /admin/weights/begin first")

    def _targets(self, req: UpdateRequest) -> list[ReplicaId]:
        """The replicas ``req`` updates: those it names (default: every one) that do not serve its
        version yet or are out of rotation (a repeat of a finished update names none)."""
        versions = self.core.versions
        named = list(req.replicas) if req.replicas is not None else self.life.pool.ids()
        return [rid for rid in named if versions.loaded.get(rid) != req.version or rid in versions.rotation]

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _join(self, task: asyncio.Task) -> dict[str, Any]:
        """Await ``task`` shielded: the caller going away does not cancel the update."""
        return await asyncio.shield(task)


def _same_folder(a: str, b: str) -> bool:
    """Whether two spellings of a checkpoint folder name the same one (as normalised paths: the
    folder lives on the replicas' machine, which the router may not see)."""
    return os.path.normpath(a) == os.path.normpath(b)
