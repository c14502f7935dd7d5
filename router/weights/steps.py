"""One replica's weight update, step by step (README "Version contract").

    hold     out of rotation (no new dispatch), published to the other routers first
    settle   drain: wait until no request of any router runs or waits there and the engine is
             idle (``drain_timeout_s``); what is left is dealt with by ``pause_mode``:
               wait   the replica is not updated (released on its old weights, reported)
               keep   attempts of which nothing reached the client (streams before their first
                      token too) are taken back and run again whole (``Lifecycle.preempt``);
                      the streams left, all in the engine, are frozen by ``/pause?mode=keep``
                      and continue after the update
               abort  the same, but ``/pause?mode=abort`` ends the streams (finish_reason "abort")
             then ``/pause`` (``clear_cache=false``); ``transfer: vllm`` adds ``/start_weight_update``
    load     folder form: ``reload_weights`` (the previous folder is restored if it fails)
    commit   the policy: ``flush`` resets the prefix cache (confirmed); under ``salt`` a reset
             preempts kept streams so they recompute over new KV; a refused reset restores the
             previous weights; the version is recorded, kept streams enter a new span, resume,
             back in rotation
    release  abort: previous weights (restored from their folder if asked), resume, back in rotation

Every step records what it did in a :class:`ReplicaUpdate`; nothing here raises for a replica's
failure. A replica goes back into rotation whenever it serves known weights and resumed; only
one whose weights are undefined (a failed load and a failed restore) or whose resume failed stays out.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from cache_policy.types import ReplicaId
from replicas.weights import ReplicaControl, WeightsState
from router.lifecycle import Lifecycle

log = logging.getLogger(__name__)

DRAIN_POLL_S = 0.05
ENGINE_HELD_TIMEOUT_S = 5.0
"""How long a paused engine's ``/metrics`` may take to say what it holds (``ReplicaUpdate.engine_held``)."""
PREEMPT_SETTLE_S = 5.0
"""How long preempted attempts get to leave the replica (their upstream connections closed)."""


@dataclass
class ReplicaUpdate:
    """What an update did to one replica so far (``GET /admin/weights`` shows it)."""

    replica: str
    phase: str = "queued"
    """queued | draining | paused (ready for weights) | loading | committing | done | released | failed
    | skipped (a rolling update stopped at an earlier replica's failed load: never touched)"""
    ok: bool = False
    weights: WeightsState = "previous"
    weight_version: int | None = None
    in_rotation: bool = True
    drained: bool | None = None
    preempted: int = 0
    """Non-streamed attempts taken back and run again (nothing had reached their clients)."""
    kept_streams: int = 0
    """This router's streams frozen across the update (keep) or ended by it (abort)."""
    engine_held: int | None = None
    """Requests the engine held at its ``keep`` pause, every router's (running + waiting by its
    ``/metrics``; None: not read): kept streams of other routers among them, which this router's
    own count misses, and which a prefix-cache reset must preempt or it is refused."""
    ended_streams: int = 0
    """This router's streams answering there that it ended with an error event because the update
    left the engine paused (``Lifecycle.left_paused``; other routers end theirs on its publication)."""
    engine_hung: bool = False
    """Its pause got no answer (:data:`SETTLED_PAUSE_TIMEOUT_S`): the engine hangs; a replica this
    router launched is restarted (``WeightUpdater.restart_engine``) and then caught up."""
    unconfirmed_routers: list[str] = field(default_factory=list)
    """Other routers that had not confirmed the new version when the engine resumed (within
    ``router.state.redis_state.MARK_TIMEOUT_S``; ``"redis"``: it could not be asked)."""
    pause_mode: str = "wait"
    reset_confirmed: bool | None = None
    error: str | None = None
    seconds: float = 0.0
    paused_s: float = 0.0
    """Seconds the engine was paused (``/pause`` answered to ``/resume`` answered)."""
    paused_after_s: float | None = None
    """Seconds from this replica's hold to its engine's pause (the drain, and taking work back)."""
    started: float = field(default_factory=time.monotonic, repr=False)
    paused_at: float | None = field(default=None, repr=False)
    load_failed: bool = field(default=False, repr=False)
    """Its load (``Steps.load``) was answered with an error: the weights, not the replica, may be at fault."""

    def note(self, error: str | None) -> bool:
        """Add ``error`` (if any) to the record; True when there was none."""
        if error:
            self.error = f"{self.error}; {error}" if self.error else error
        return error is None

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("started"), out.pop("paused_at"), out.pop("load_failed")
        out["seconds"] = round(time.monotonic() - self.started, 3) if self.phase not in (
            "done", "released", "failed", "skipped") else round(self.seconds, 3)
        out["paused_s"] = round(self.paused_s, 3)
        return out


SETTLED_PAUSE_TIMEOUT_S = 60.0
"""How long the pause of a settled replica may take (``Steps.settle``): nothing runs there but
streams the engine decodes (``keep`` freezes them, ``abort`` ends them), so an engine that does not
answer by then hangs (``ReplicaUpdate.engine_hung``)."""


class Steps:
    """The steps of one update over the router's replicas (see the module docstring)."""

    def __init__(self, life: Lifecycle, initial_path: str | None = None) -> None:
        self.life, self.core = life, life.core
        self.folders: dict[int, str] = {}
        """Per version, the folder this router loaded it from, or started on (``initial_path``).
        Only its own: another router's update tells it the version, not the folder."""
        if initial_path is not None and self.core.versions.initial is not None:
            self.folders[self.core.versions.initial] = initial_path
        self.missed: set[ReplicaId] = set()
        """Replicas an update passed by because their engine was stalled (:meth:`hold`): brought to
        the fleet's version once they move again (``WeightUpdater.catch_up_recovered``)."""
        self.hung: set[ReplicaId] = set()
        """Replicas an update left paused because their pause got no answer (engine hung) and that
        this router cannot restart (given by URL): resumed once their engine answers again, then
        brought to the fleet's version (``WeightUpdater.catch_up_recovered``)."""

    def folder_of(self, rid: ReplicaId) -> str | None:
        """The folder of the weights ``rid`` serves now (what a failed load restores), if one is
        known: the version it serves was loaded from a folder, here or by another router (its
        publication carries the folder: ``shared_folder``), or is the initial one. None when
        they were pushed without a folder."""
        version = self.core.versions.loaded.get(rid)
        return None if version is None else self.folder_of_version(version)

    def folder_of_version(self, version: int) -> str | None:
        """The folder ``version`` was loaded from, here or by another router; None if none."""
        shared = self.life.shared
        return self.folders.get(version) or (shared.shared_folder(version) if shared is not None else None)

    def control(self, rid: ReplicaId) -> ReplicaControl:
        return ReplicaControl(self.life.http, self.life.pool.get(rid).endpoint.base_url)

    async def publish(self, recomputed: dict[ReplicaId, bool] | None = None) -> bool:
        """Versions and rotation to the other routers (``router.state``); True without any.
        ``recomputed``: replicas whose version just moved, and whether their kept streams
        recomputed their context (the others' new spans say so)."""
        shared = self.life.shared
        return True if shared is None else bool(await shared.publish_versions(self.core, recomputed, self.folders))

    async def hold(self, rid: ReplicaId, rec: ReplicaUpdate) -> bool:
        """Out of rotation; False (and back in) when the others could not be told. False, and
        not held, when its engine is stalled (``DecisionCore.stalled``): its pause would wait on
        the hang (up to the pause's timeout) while an update's hold turns the stall rule, the
        probes and the restart off; left to them, it is brought to the fleet's version once it
        moves again (:attr:`missed`)."""
        if self.core.stalled(rid, time.monotonic()):
            rec.phase, rec.weight_version = "failed", self.core.versions.loaded.get(rid)
            rec.note(f"not updated: its engine is stalled ({self.core.replicas[rid].stalls} stall(s) in a row, no "
                     "token finished); it stays out by the stall rule (probed; a launched replica is restarted "
                     "after policy.stall_restart_after stalls) and is brought to the fleet's version once it moves")
            self.missed.add(rid)
            return False
        self.core.set_rotation(rid, "updating")
        self.life.rotation_changed()
        rec.in_rotation, rec.weight_version = False, self.core.versions.loaded.get(rid)
        if await self.publish():
            return True
        self.core.set_rotation(rid, None)
        self.life.rotation_changed()
        rec.in_rotation, rec.phase = True, "failed"
        rec.note("shared state unreachable: other routers could not be told to hold dispatch; not updated")
        # the hold may have been written all the same (its answer lost): the other routers must
        # see the replica back too; if this fails as well, the sync round publishes it again
        await self.publish()
        return False

    async def settle(self, rid: ReplicaId, rec: ReplicaUpdate, pause_mode: str, drain_s: float,
                     transfer: bool = False) -> bool:
        """Drain, deal with what is left by ``pause_mode``, pause; True when paused (ready)."""
        rec.phase = "draining"
        ctl = self.control(rid)
        rec.drained = await self._drain(rid, ctl, drain_s)
        if not rec.drained:
            if pause_mode == "wait":
                rec.note(f"in-flight requests did not finish within drain_timeout_s={drain_s}; not updated "
                         "(pause_mode 'wait' never aborts or mixes work)")
                return False
            rec.preempted = self.life.preempt(rid, f"replica {rid} is being updated ({pause_mode})")
            await self._leave(rid)
        streams = [f for f in self.life.flights.get(rid, {}).values() if f.streaming and f.preempted is None]
        rec.kept_streams, rec.pause_mode = len(streams), pause_mode
        rec.paused_at = time.monotonic()  # from here on, release() resumes: a failed pause may have paused
        # drained (wait), or left only streams the engine decodes (keep, abort): the pause is quick
        # unless the engine hangs, which a pause must not wait out for the longest request's time
        if not rec.note(await ctl.pause(pause_mode, SETTLED_PAUSE_TIMEOUT_S)):  # type: ignore[arg-type]
            if ctl.pause_refused:  # answered 4xx (a server without dev mode): never paused, nothing to resume
                rec.paused_at = None
            rec.engine_hung = ctl.pause_unanswered
            return False
        rec.paused_after_s = round(time.monotonic() - rec.started, 3)
        if pause_mode == "keep":
            rec.engine_held = await ctl.engine_busy(timeout_s=ENGINE_HELD_TIMEOUT_S)
        if transfer and not rec.note(await ctl.start_transfer()):
            return False
        rec.phase = "paused"
        return True

    async def load(self, rid: ReplicaId, rec: ReplicaUpdate, path: str) -> bool:
        """Folder form: reload ``path``; True when the new weights are in."""
        rec.phase = "loading"
        rec.weights, error = await self.control(rid).load(path, self.folder_of(rid))
        rec.load_failed = not rec.note(error)
        return rec.weights == "new"

    def skip(self, rid: ReplicaId, rec: ReplicaUpdate, failed: ReplicaId, path: str, pause_mode: str) -> None:
        """Not updated: loading ``path`` failed on ``failed`` first (a rolling update stops there
        rather than pause every replica to try the same weights again)."""
        rec.phase, rec.weight_version, rec.pause_mode = "skipped", self.core.versions.loaded.get(rid), pause_mode
        rec.note(f"not updated: loading {path!r} failed on {failed} first (a rolling update stops at its first "
                 "failed load; fix the weights and update again)")

    async def commit(self, rid: ReplicaId, rec: ReplicaUpdate, version: int, policy: str, preempt_running: bool,
                     *, transfer: bool = False, new_path: str | None = None) -> None:
        """New weights are in: apply ``policy``, record ``version``, mark kept streams, resume.
        ``new_path``: a folder holding them (restores later updates), None when pushed."""
        rec.phase, rec.weights = "committing", "new"
        ctl = self.control(rid)
        kept = rec.pause_mode == "keep" and self._holds_work(rid, rec)  # abort ended them at the pause
        may_preempt = policy == "salt" or (policy == "flush" and preempt_running)
        preempt = kept and may_preempt
        if policy == "flush" or preempt:
            outcome = await ctl.reset(preempt)
            if not outcome.confirmed and not preempt and rec.pause_mode == "keep" and may_preempt:
                # refused for requests no count showed (another router's stream its last heartbeat
                # had not carried yet, an engine gauge behind its scheduler): they are kept ones
                log.info("replica %s: the prefix-cache reset was refused (%s); again, preempting what the engine "
                         "holds", rid, outcome.detail)
                preempt = kept = True
                outcome = await ctl.reset(True)
            rec.reset_confirmed = outcome.confirmed
            if not outcome.confirmed:
                rec.note(f"prefix cache not reset ({outcome.detail}): the new weights would run over old KV")
                rec.weights, error = await ctl.restore(self.folder_of(rid), "commit refused")
                rec.note(error if rec.weights != "previous" else None)
                return await self._resume(rid, rec, ctl)
        if transfer:
            rec.note(await ctl.finish_transfer(f"v{version}"))
        self.core.version_loaded(rid, version)
        if new_path:  # pushed weights have no folder unless the trainer names one
            self.folders[version] = new_path
        if rec.reset_confirmed:
            self.core.cache_reset(rid)
        recomputed = bool(rec.reset_confirmed) and preempt
        if kept:
            await self.life.mark_new_spans(rid, version, recomputed)
        rec.weight_version = version
        self.core.finish_update(version, policy)  # type: ignore[arg-type]  # new work moves to it
        await self._tell_before_resume(rid, rec, recomputed)
        await self._resume(rid, rec, ctl)
        rec.ok = rec.in_rotation and rec.error is None

    def _holds_work(self, rid: ReplicaId, rec: ReplicaUpdate) -> bool:
        """Whether ``rid``'s paused engine holds requests of any router: this router's kept
        streams, other routers' work there as their last heartbeats showed it, or the engine's own
        count at the pause (``engine_held``). A fresh attacker's flush through router B, while
        router A streamed on the replica, counted B's streams alone (none): the reset went
        without ``reset_running_requests``, vLLM refused it, and B had no folder to restore."""
        peers = self.core.in_flight_all(rid) - self.core.in_flight(rid)
        return rec.kept_streams > 0 or peers > 0 or (rec.engine_held or 0) > 0

    async def release(self, rid: ReplicaId, rec: ReplicaUpdate, restore: bool) -> None:
        """Abort: back on the previous weights (reloaded from their folder when ``restore``)."""
        ctl = self.control(rid)
        if restore and rec.paused_at is not None:
            rec.weights, error = await ctl.restore(self.folder_of(rid), "update aborted")
            rec.note(None if rec.weights == "previous" else error)
        await self._resume(rid, rec, ctl, released=True)

    async def _tell_before_resume(self, rid: ReplicaId, rec: ReplicaUpdate, recomputed: bool) -> None:
        """The new version, published while the engine is still paused, and every other router's
        word that it applied it (its answers from ``rid`` checked, its streams there in a new
        span: ``Lifecycle.mark_new_spans``) before a token of it is computed: else another
        router relays new-version tokens as the old version's (a fresh attacker saw all 44 such
        streams do so under ``keep``). Bounded (``shared.await_marked``); late routers are reported."""
        shared = self.life.shared
        if shared is None or not await self.publish(recomputed={rid: recomputed}):
            return
        rec.unconfirmed_routers = await shared.await_marked()
        if rec.unconfirmed_routers:
            log.warning("router(s) %s did not confirm version %s of %s before its resume: their answers from it "
                        "may name the old version for new tokens", ", ".join(rec.unconfirmed_routers),
                        rec.weight_version, rid)

    async def _resume(self, rid: ReplicaId, rec: ReplicaUpdate, ctl: ReplicaControl, released: bool = False) -> None:
        """Resume (unless the weights are undefined) and put ``rid`` back when it serves known weights."""
        if rec.weights == "undefined":
            self.core.version_loaded(rid, None)
            rec.note("replica left paused: resuming with undefined weights would crash its engine")
        elif rec.engine_hung:  # a resume would wait on the hang as the pause did (3 x 30 s)
            rec.note("not resumed: its engine hangs (it may hold the pause when it wakes)")
        elif rec.paused_at is None or rec.note(await ctl.resume()):
            if rec.paused_at is not None:
                rec.paused_s = time.monotonic() - rec.paused_at
            self.core.set_rotation(rid, None)
            rec.in_rotation = True
        if not rec.in_rotation:
            reason = f"failed: {rec.error}"  # left paused (sharing.left_paused): nothing kept there runs on
            self.core.set_rotation(rid, reason)
            rec.ended_streams = self.life.left_paused(rid, f"replica {rid} was left paused by a weight update that {reason}")
        rec.weight_version = self.core.versions.loaded.get(rid)
        rec.phase = "failed" if not rec.in_rotation else ("released" if released or rec.weights != "new" else "done")
        rec.seconds = time.monotonic() - rec.started
        self.life.rotation_changed()
        await self.publish()

    async def _drain(self, rid: ReplicaId, ctl: ReplicaControl, timeout_s: float) -> bool:
        """Wait until no router has work on ``rid`` and its engine runs and queues nothing."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.core.in_flight_all(rid) == 0 and await ctl.engine_busy() in (0, None):
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(DRAIN_POLL_S)

    async def _leave(self, rid: ReplicaId) -> None:
        """Let preempted attempts finish leaving (their connections closed: vLLM aborts them)."""
        deadline = time.monotonic() + PREEMPT_SETTLE_S
        while time.monotonic() < deadline and any(
                f.preempted is not None for f in self.life.flights.get(rid, {}).values()):
            await asyncio.sleep(DRAIN_POLL_S)
