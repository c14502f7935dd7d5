"""``/admin/weights``: weight updates orchestrated through the router (DESIGN rules 4 and 6, seed 003,
README "Version contract"). Every call needs ``Authorization: Bearer <router.admin_token>``.

    POST /admin/weights          folder form, one call: each target (rolling, or all at once) is
                                 held out of rotation, drained per pause_mode, paused, reloaded
                                 from weights_path, the policy applied, resumed, put back
    POST /admin/weights/begin    two-phase: hold, drain, pause every target; 200 when all are
                                 ready to receive the trainer's weights (out of band)
    POST /admin/weights/commit   the weights are in: record the version, apply the policy, resume
    POST /admin/weights/abort    resume every target on its previous weights
    GET  /admin/weights          versions, rotation, each replica's phase, the update running

Bodies: ``router.weights.requests``. Answers carry the update's report (``ok``, ``phase``,
``version``, ``policy``, ``pause_mode``, ``paused_s``, per replica: ``phase``, ``ok``, ``weights``
new|previous|undefined, ``weight_version``, ``in_rotation``, ``drained``, ``preempted``,
``kept_streams``, ``reset_confirmed``, ``error``, ``seconds``, ``paused_s``; ``state``: versions
and rotation after it): 200 when every target did what was asked, 502 when one did not (it is
back in rotation on its previous weights unless its weights are undefined); 401 without the
token; 400 naming a bad field; 409 while another update runs (or, for commit/abort, when no
update of that version was begun); 503 when shared state cannot coordinate the routers.
The update runs as a task the app owns: a client going away never stops it halfway, and the
same call made again joins it or returns its report.
"""

from __future__ import annotations

import hmac
from pathlib import Path

from aiohttp import web

from router import fleet, keys
from router.config import AppConfig
from router.edge import body_of
from router.errors import Unauthorized
from router.lifecycle import Lifecycle
from router.parse import load_json_object
from router.weights.requests import UpdateRequest, parse_abort, parse_begin, parse_commit, parse_update
from router.weights.updater import UpdateInProgress, WeightUpdater

__all__ = ["UpdateInProgress", "UpdateRequest", "WeightUpdater", "make_updater", "parse_update"]


def make_updater(cfg: AppConfig, life: Lifecycle) -> WeightUpdater:
    """The app's updater; the initial version's folder is ``_initial_weights_path``."""
    return WeightUpdater(life, _initial_weights_path(cfg, [s.endpoint.model_root for s in life.pool.states()]))


def check_token(request: web.Request) -> None:
    """Unauthorized (401) unless the request carries ``router.admin_token`` as a Bearer token."""
    expected = request.app[keys.CONFIG].router.admin_token
    given = request.headers.get("Authorization", "")
    scheme, _, token = given.partition(" ")
    if not expected or scheme.lower() != "bearer" or not hmac.compare_digest(token.strip(), expected):
        raise Unauthorized("admin endpoints need 'Authorization: Bearer <router.admin_token>'"
                           + ("" if expected else " (router.admin_token is not set: admin is disabled)"))


async def _body(request: web.Request) -> dict:
    check_token(request)
    return load_json_object(body_of(request))


def _answer(report: dict) -> web.Response:
    return web.json_response(report, status=200 if report["ok"] else 502)


async def post_weights(request: web.Request) -> web.Response:
    """POST /admin/weights: the folder form."""
    body = await _body(request)
    app = request.app
    req = parse_update(body, app[keys.CONFIG], app[keys.POOL].ids(), app[keys.CORE].versions.current)
    return _answer(await app[keys.WEIGHT_UPDATER].update(req))


async def post_begin(request: web.Request) -> web.Response:
    """POST /admin/weights/begin."""
    body = await _body(request)
    app = request.app
    req = parse_begin(body, app[keys.CONFIG], app[keys.POOL].ids(), app[keys.CORE].versions.current)
    return _answer(await app[keys.WEIGHT_UPDATER].begin(req))


async def post_commit(request: web.Request) -> web.Response:
    """POST /admin/weights/commit."""
    version, path = parse_commit(await _body(request))
    return _answer(await request.app[keys.WEIGHT_UPDATER].commit(version, path))


async def post_abort(request: web.Request) -> web.Response:
    """POST /admin/weights/abort."""
    version, restore = parse_abort(await _body(request))
    return _answer(await request.app[keys.WEIGHT_UPDATER].abort(version, restore))


async def get_weights(request: web.Request) -> web.Response:
    """GET /admin/weights: current version, policy, each replica's version, rotation and phase."""
    check_token(request)
    return web.json_response(request.app[keys.WEIGHT_UPDATER].describe(fleet.out_of_rotation(request.app)))


def _initial_weights_path(cfg: AppConfig, roots: list[str | None]) -> str | None:
    """``router.initial_weights_path``, else the replicas' model when it is a local folder
    (``replicas.served_model.model_source``: with ``replicas.urls``, a server's model ``roots``)."""
    if cfg.router.initial_weights_path:
        return cfg.router.initial_weights_path
    from replicas.served_model import model_source

    path = model_source(cfg.replicas, roots)
    return path if path and Path(path).is_dir() else None
