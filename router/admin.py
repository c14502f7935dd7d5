"""``/admin/weights``: weight updates orchestrated through the router (DESIGN rule 4, seed 003).

``POST /admin/weights`` with ``Authorization: Bearer <router.admin_token>`` and a JSON body::

    {"version": 7, "weights_path": "/ckpt/step-7",   # required: new version, checkpoint folder
     "policy": "keep+salt",     # flush | keep | salt | keep+salt   (router.weight_update_policy)
     "mode": "rolling",         # rolling | all                     (router.weight_update_mode)
     "pause_mode": "wait",      # wait | keep | abort                (router.weight_update_pause_mode)
     "preempt_running": true,   # flush only: the reset may preempt kept requests (router.flush_preempt_running)
     "replicas": ["replica-0"]} # default: every replica not already serving `version` in rotation

Each replica, one at a time (``rolling``: the others keep serving) or all at once: out of
rotation -> pause -> reload the weights (``replicas.weights.update_weights``) -> under ``flush``
a confirmed prefix-cache reset -> record the loaded version -> resume -> back in rotation. The
first replica that succeeds makes ``version`` (and ``policy``) current, so new work moves to
the new weights while old-version work drains. A replica whose update fails (load failed, reset
not confirmed, resume failed) stays out of rotation and is reported, never left serving silently.

Answers: 200 when every replica updated, 502 when one failed; both carry the report
``{"ok", "version", "policy", "mode", "pause_mode", "seconds", "replicas": [per replica: "replica",
"ok", "weight_version", "reset_confirmed", "weights", "error", "seconds"], "state": versions and
rotation after the update}``; 401 without the right token (nothing changes); 400 naming a bad field; 409 while
another update runs. ``GET /admin/weights`` (same token) shows versions and rotation.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from cache_policy.salts import WEIGHT_UPDATE_POLICIES
from cache_policy.types import ReplicaId
from replicas.weights import PAUSE_MODES, WeightUpdateResult, update_weights
from router import keys
from router.config import AppConfig
from router.errors import BadRequest, RouterError, Unauthorized
from router.lifecycle import Lifecycle
from router.parse import load_json_object

MODES = ("rolling", "all")


class UpdateInProgress(RouterError):
    """Another weight update is running (409)."""

    status = 409
    type = "conflict"


@dataclass(frozen=True)
class UpdateRequest:
    """A validated ``POST /admin/weights`` body, defaults filled from ``RouterConfig``."""

    version: int
    weights_path: str
    policy: str
    mode: str
    pause_mode: str
    preempt_running: bool
    replicas: tuple[ReplicaId, ...] | None


@dataclass(frozen=True)
class ReplicaReport:
    """What the update did to one replica."""

    replica: str
    ok: bool
    weight_version: int | None
    reset_confirmed: bool | None
    weights: str
    error: str | None
    seconds: float


class WeightUpdater:
    """Runs one weight update at a time over the router's replicas."""

    def __init__(self, cfg: AppConfig, lifecycle: Lifecycle) -> None:
        self.cfg = cfg
        self.lifecycle = lifecycle
        self.core = lifecycle.core
        self.versions = lifecycle.core.versions
        self.pool = lifecycle.pool
        self._lock = asyncio.Lock()
        initial = _initial_weights_path(cfg, [s.endpoint.model_root for s in self.pool.states()])
        self.paths: dict[ReplicaId, str | None] = dict.fromkeys(self.pool.ids(), initial)
        self.last_report: dict[str, Any] | None = None

    async def update(self, req: UpdateRequest) -> dict[str, Any]:
        """Carry out ``req``; return the report (``ok`` False when a replica failed)."""
        if self._lock.locked():
            raise UpdateInProgress("a weight update is already running; retry when it has finished")
        async with self._lock:
            started = time.monotonic()
            targets = self._targets(req)
            if req.mode == "all":
                self._take_out(targets, "updating")
                reports = list(await asyncio.gather(*(self._update_one(rid, req) for rid in targets)))
            else:
                reports = [await self._update_one(rid, req) for rid in targets]
            if not targets:
                self.core.finish_update(req.version, req.policy)  # nothing to load: version/policy only
            self.last_report = {
                "ok": all(r.ok for r in reports), "version": req.version, "policy": req.policy, "mode": req.mode,
                "pause_mode": req.pause_mode, "seconds": round(time.monotonic() - started, 3),
                "replicas": [asdict(r) for r in reports], "state": self.versions.describe(),
            }
            return self.last_report

    def _targets(self, req: UpdateRequest) -> list[ReplicaId]:
        if req.replicas is not None:
            return list(req.replicas)
        return [rid for rid in self.pool.ids()
                if self.versions.loaded.get(rid) != req.version or rid in self.versions.rotation]

    async def _update_one(self, rid: ReplicaId, req: UpdateRequest) -> ReplicaReport:
        self._take_out([rid], "updating")
        flush = req.policy == "flush"
        result = await update_weights(
            self.lifecycle.http, self.pool.get(rid).endpoint.base_url, req.weights_path,
            pause_mode=req.pause_mode, reset_prefix_cache=flush, preempt_running=flush and req.preempt_running,
            restore_path=self.paths.get(rid))
        self._record(rid, req, result)
        return ReplicaReport(rid, result.ok, self.versions.loaded.get(rid), result.reset_confirmed, result.weights,
                             result.error, round(result.seconds, 3))

    def _record(self, rid: ReplicaId, req: UpdateRequest, result: WeightUpdateResult) -> None:
        """Tell the core what one replica's update did: loaded version, cache, rotation."""
        if result.weights == "new":
            self.core.version_loaded(rid, req.version)
            self.paths[rid] = req.weights_path
        elif result.weights == "undefined":
            self.core.version_loaded(rid, None)
        if result.reset_confirmed:
            self.core.cache_reset(rid)  # its cache is empty now: predict no hits there
        if result.ok:
            self.core.finish_update(req.version, req.policy)
            self.core.set_rotation(rid, None)
        else:
            self.core.set_rotation(rid, f"failed: {result.error}")
        self.lifecycle.rotation_changed()

    def _take_out(self, rids: list[ReplicaId], reason: str) -> None:
        for rid in rids:
            self.core.set_rotation(rid, reason)
        self.lifecycle.rotation_changed()


def parse_update(body: dict[str, Any], cfg: AppConfig, known: list[ReplicaId], current: int | None) -> UpdateRequest:
    """Validate a ``POST /admin/weights`` body; BadRequest naming the field."""
    version = body.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise BadRequest("'version' must be an integer >= 0", param="version")
    if current is not None and version < current:
        raise BadRequest(f"'version' {version} is older than the current version {current}", param="version")
    path = body.get("weights_path")
    if not isinstance(path, str) or not path:
        raise BadRequest("'weights_path' must be a checkpoint folder on the replicas' machine", param="weights_path")
    r = cfg.router
    policy = _choice(body, "policy", WEIGHT_UPDATE_POLICIES, r.weight_update_policy)
    mode = _choice(body, "mode", MODES, r.weight_update_mode)
    pause_mode = _choice(body, "pause_mode", PAUSE_MODES, r.weight_update_pause_mode)
    preempt = body.get("preempt_running", r.flush_preempt_running)
    if not isinstance(preempt, bool):
        raise BadRequest("'preempt_running' must be a boolean", param="preempt_running")
    replicas = body.get("replicas")
    if replicas is not None:
        if not isinstance(replicas, list) or not replicas or any(x not in known for x in replicas):
            raise BadRequest(f"'replicas' must be a non-empty list of replica ids among {known}", param="replicas")
        replicas = tuple(dict.fromkeys(replicas))
    return UpdateRequest(version, path, policy, mode, pause_mode, preempt, replicas)


def _choice(body: dict[str, Any], name: str, choices: tuple[str, ...], default: str) -> str:
    value = body.get(name, default)
    if value not in choices:
        raise BadRequest(f"'{name}' must be one of {', '.join(choices)}", param=name)
    return value


def check_token(request: web.Request) -> None:
    """Unauthorized (401) unless the request carries ``router.admin_token`` as a Bearer token."""
    expected = request.app[keys.CONFIG].router.admin_token
    given = request.headers.get("Authorization", "")
    scheme, _, token = given.partition(" ")
    if not expected or scheme.lower() != "bearer" or not hmac.compare_digest(token.strip(), expected):
        raise Unauthorized("admin endpoints need 'Authorization: Bearer <router.admin_token>'"
                           + ("" if expected else " (router.admin_token is not set: admin is disabled)"))


async def post_weights(request: web.Request) -> web.Response:
    """POST /admin/weights handler."""
    check_token(request)
    updater = request.app[keys.WEIGHT_UPDATER]
    versions = request.app[keys.CORE].versions
    req = parse_update(load_json_object(await request.read()), request.app[keys.CONFIG],
                       request.app[keys.POOL].ids(), versions.current)
    report = await updater.update(req)
    return web.json_response(report, status=200 if report["ok"] else 502)


async def get_weights(request: web.Request) -> web.Response:
    """GET /admin/weights: current version, policy, each replica's version and rotation."""
    check_token(request)
    updater = request.app[keys.WEIGHT_UPDATER]
    return web.json_response({**request.app[keys.CORE].versions.describe(), "last_update": updater.last_report})


def _initial_weights_path(cfg: AppConfig, roots: list[str | None]) -> str | None:
    """``router.initial_weights_path``, else the replicas' model when it is a local folder
    (``replicas.served_model.model_source``: with ``replicas.urls``, a server's model ``roots``)."""
    if cfg.router.initial_weights_path:
        return cfg.router.initial_weights_path
    from replicas.served_model import model_source

    path = model_source(cfg.replicas, roots)
    return path if path and Path(path).is_dir() else None
