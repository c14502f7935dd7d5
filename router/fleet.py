"""The router's side of a fleet that changes while it serves (issue 12).

* Replica events from the replica set (``replicas.events``) become core events: a restarted
  replica's new URL replaces the old one in the pool and its prefix-index entries and pins are
  forgotten (its cache is empty); an unhealthy or draining one leaves rotation, and the sessions
  pinned there move on their next turn to the replica holding their longest prefix; a removed one
  is dropped. Each event also re-follows the replicas' KV events.
* ``GET/POST /admin/replicas`` and ``DELETE /admin/replicas/{replica_id}`` (admin token): list,
  add (start one from the config, or register ``{"url": ...}``) and remove (``?drain_s=30``:
  no new work, wait until the router has nothing in flight there, then stop; else at once).
"""

from __future__ import annotations

import logging

from aiohttp import web

from replicas.config import StartupError
from replicas.events import ReplicaEvent
from replicas.replica_set import ReplicaEndpoint
from router import keys
from router.body import load_json_object
from router.edge import body_of
from router.errors import BadRequest, RouterError, echo
from router.kv_events import KV_EVENTS, sync_watches

log = logging.getLogger(__name__)

FLEET = web.AppKey("fleet", object)
"""The ``replicas.replica_set.ReplicaSet`` behind the router (None: fixed endpoints only)."""


class NoFleet(RouterError):
    """The router fronts a fixed list of endpoints: nothing to add or remove (409)."""

    status = 409


def attach_fleet(app: web.Application, replica_set) -> None:
    """Follow ``replica_set``'s events (call before the app starts serving) until the app stops
    (a stopped router must not keep receiving them: several routers may serve one set in turn)."""
    app[FLEET] = replica_set
    if replica_set is not None:
        unsubscribe = replica_set.subscribe(lambda event: on_replica_event(app, event))

        async def stop_following(_: web.Application) -> None:
            unsubscribe()

        app.on_cleanup.append(stop_following)


def on_replica_event(app: web.Application, event: ReplicaEvent) -> None:
    """Carry one replica event into the pool and the decision core; log it (a warning when the
    replica stops serving) and set its ``rollout_router_replica_healthy`` gauge."""
    core, pool, rid = app[keys.CORE], app[keys.POOL], event.replica_id
    kind, endpoint = event.kind, event.endpoint
    log.log(logging.WARNING if kind in ("unhealthy", "restarting", "removed") else logging.INFO,
            "replica %s %s%s%s", rid, kind, f" at {endpoint.base_url}" if kind in ("added", "restarted") else "",
            f": {event.reason}" if event.reason else "")
    if kind in ("added", "restarted"):
        _set_endpoint(pool, endpoint)
        if kind == "added" or rid not in core.replicas:
            core.add_replica(rid, block_size=endpoint.block_size, num_gpu_blocks=endpoint.num_gpu_blocks,
                             scoring_cap=endpoint.scoring_cap)
        else:
            core.restarted(rid, num_gpu_blocks=endpoint.num_gpu_blocks, scoring_cap=endpoint.scoring_cap)
        core.set_health(rid, True)
        core.set_rotation(rid, None)
    elif kind in ("unhealthy", "restarting"):
        core.set_health(rid, False)
    elif kind == "healthy":
        core.set_health(rid, True)
    elif kind == "draining":
        core.set_rotation(rid, "draining")
    elif kind == "removed":
        core.remove_replica(rid, 0.0)
        pool.set_endpoints([s.endpoint for s in pool.states() if s.endpoint.replica_id != rid])
    if keys.METRICS in app:
        app[keys.METRICS].healthy.labels(rid).set(1 if rid in core.replicas and core.replicas[rid].healthy else 0)
        if kind == "removed":
            app[keys.METRICS].forget_replica(rid)
    subscriber = app.get(KV_EVENTS)
    if subscriber is not None:
        sync_watches(subscriber, [s.endpoint for s in pool.states() if s.endpoint.replica_id in core.replicas])
    if keys.LIFECYCLE in app:
        app[keys.LIFECYCLE].rotation_changed()


def _set_endpoint(pool, endpoint: ReplicaEndpoint) -> None:
    others = [s.endpoint for s in pool.states() if s.endpoint.replica_id != endpoint.replica_id]
    pool.set_endpoints(others + [endpoint])


def _fleet(request: web.Request):
    fleet = request.app.get(FLEET)
    if fleet is None:
        raise NoFleet("this router fronts a fixed list of replica URLs; start it with `rollout-router serve` "
                      "to add or remove replicas")
    return fleet


async def list_replicas(request: web.Request) -> web.Response:
    """GET /admin/replicas: every replica, its URL, health, rotation and load."""
    core, pool = request.app[keys.CORE], request.app[keys.POOL]
    return web.json_response({"replicas": [{
        "replica": s.endpoint.replica_id, "url": s.endpoint.base_url,
        "healthy": s.endpoint.replica_id in core.replicas and core.replicas[s.endpoint.replica_id].healthy,
        "in_rotation": s.endpoint.replica_id not in core.versions.rotation,
        "out_of_rotation_reason": core.versions.rotation.get(s.endpoint.replica_id),
        "in_flight": core.in_flight(s.endpoint.replica_id),
    } for s in pool.states()]})


async def add_replica(request: web.Request) -> web.Response:
    """POST /admin/replicas ``{}`` (start one from the config) or ``{"url": "http://..."}`` (register)."""
    body = load_json_object(body_of(request)) if request.body_exists else {}
    url = body.get("url")
    if url is not None and (not isinstance(url, str) or not url.startswith(("http://", "https://"))):
        raise BadRequest("'url' must be an http(s) URL of a running vLLM server", param="url")
    fleet = _fleet(request)
    if url is None and fleet.cfg.urls:
        raise BadRequest("this router fronts servers given by replicas.urls: it launches none; "
                         "register a running server with {\"url\": \"http://...\"}", param="url")
    if url is not None and url.rstrip("/") in {s.endpoint.base_url for s in request.app[keys.POOL].states()}:
        raise BadRequest(f"{echo(url)} is already a replica of this router", param="url")
    try:
        endpoint = await fleet.add(url)
    except StartupError as exc:  # unreachable, or a block size the fleet does not share
        raise BadRequest(f"cannot add the replica: {exc}", param="url" if url is not None else "body") from exc
    await request.app[FLEET].events.flush()  # the router follows it before answering
    return web.json_response({"replica": endpoint.replica_id, "url": endpoint.base_url}, status=201)


async def remove_replica(request: web.Request) -> web.Response:
    """DELETE /admin/replicas/{replica_id}[?drain_s=S]: drained (no new work, in-flight finishes
    within S seconds, sessions move) or at once."""
    rid = request.match_info["replica_id"]
    core = request.app[keys.CORE]
    if rid not in core.replicas:
        raise BadRequest(f"unknown replica {echo(rid)!r}; known: {sorted(core.replicas)}", param="replica_id")
    unknown = sorted(set(request.query) - {"drain_s"})
    if unknown:
        raise BadRequest(f"unknown query parameter(s) {echo(unknown)}; the drain time is 'drain_s'", param=unknown[0])
    drain = request.query.get("drain_s")
    try:
        drain_s = None if drain is None else float(drain)
    except ValueError:
        drain_s = -1.0
    if drain_s is not None and not 0 <= drain_s <= 3600:
        raise BadRequest("'drain_s' must be a number of seconds in [0, 3600]", param="drain_s")

    async def idle() -> bool:
        return core.in_flight(rid) == 0

    drained = await _fleet(request).remove(rid, drain_timeout_s=drain_s, idle=idle)
    await request.app[FLEET].events.flush()
    return web.json_response({"replica": rid, "removed": True, "drained": drained})
