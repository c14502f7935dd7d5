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

import asyncio
import logging
import time
from typing import Any

from aiohttp import web

from replicas.addresses import canonical_url, resolve
from replicas.config import StartupError
from replicas.events import ReplicaEvent
from replicas.membership import poll_until
from replicas.replica_set import ReplicaEndpoint
from router import keys
from router.body import load_json_object
from router.edge import body_of
from router.errors import BadRequest, RouterError, echo
from router.kv_events import KV_EVENTS, sync_watches
from router.state.redis_client import StateUnavailable

log = logging.getLogger(__name__)

FLEET = web.AppKey("fleet", object)
"""The ``replicas.replica_set.ReplicaSet`` behind the router (None: fixed endpoints only)."""
ADDING = web.AppKey("adding", set)
"""Addresses (``replicas.addresses.resolve``) of the servers being added right now."""
RESTARTING = web.AppKey("restarting", dict)
"""Replicas being restarted now, each with why (from its ``restarting`` event until the next
event): ``GET /admin/replicas`` lists them out of rotation. A view only: placement skips them
as unhealthy, and an update's targets are not changed by it."""
ADD_TASKS = web.AppKey("add_tasks", set)
"""The ``POST /admin/replicas`` calls running now, owned by the app (their clients may be gone)."""
ADD_HOLD_S = 120.0
"""With shared state, how long a server being added is held on every router at most (its probes
take seconds; a router that dies while adding one frees it after this)."""


class NoFleet(RouterError):
    """The router fronts a fixed list of endpoints: nothing to add or remove (409)."""

    status = 409


def attach_fleet(app: web.Application, replica_set) -> None:
    """Follow ``replica_set``'s events (call before the app starts serving) until the app stops
    (a stopped router must not keep receiving them: several routers may serve one set in turn)."""
    app[FLEET] = replica_set
    app[ADDING] = set()
    app[ADD_TASKS] = set()
    app[RESTARTING] = {}
    if replica_set is not None:
        unsubscribe = replica_set.subscribe(lambda event: _own_event(app, replica_set, event))
        replica_set.claim_index = lambda floor: _claim_index(app, floor)

        async def stop_following(_: web.Application) -> None:
            unsubscribe()
            replica_set.claim_index = None
            for task in list(app[ADD_TASKS]):  # a launch still running: the replica set stops what it started
                task.cancel()
            await asyncio.gather(*app[ADD_TASKS], return_exceptions=True)

        app.on_cleanup.append(stop_following)


def _own_event(app: web.Application, replica_set, event: ReplicaEvent) -> None:
    """An event of this router's own replica set: :func:`on_replica_event`; then a replica it
    launched that joined or restarted serves ``replicas.model``'s weights, so the weight
    updater labels it so and brings it to the fleet's version (``WeightUpdater.rejoined``)."""
    on_replica_event(app, event)
    updater = app.get(keys.WEIGHT_UPDATER)
    if event.kind in ("added", "restarted") and updater is not None and replica_set.launched(event.replica_id):
        updater.rejoined(event.replica_id)


def on_replica_event(app: web.Application, event: ReplicaEvent) -> None:
    """Carry one replica event into the pool and the decision core; log it (a warning when the
    replica stops serving) and set its ``rollout_router_replica_healthy`` gauge."""
    core, pool, rid = app[keys.CORE], app[keys.POOL], event.replica_id
    kind, endpoint = event.kind, event.endpoint
    log.log(logging.WARNING if kind in ("unhealthy", "restarting", "removed") else logging.INFO,
            "replica %s %s%s%s", rid, kind, f" at {endpoint.base_url}" if kind in ("added", "restarted") else "",
            f": {event.reason}" if event.reason else "")
    restarting = app.get(RESTARTING)
    if restarting is not None:  # listed out of rotation until it is back (shown in rotation while
        if kind == "restarting":  # dead for a whole restart, it misled a fresh attacker)
            restarting[rid] = f"restarting: {event.reason}" if event.reason else "restarting"
        elif kind in ("added", "restarted", "healthy", "removed"):
            restarting.pop(rid, None)
    if kind in ("added", "restarted"):
        _set_endpoint(pool, endpoint)
        state = pool.get(rid)
        state.gone = state.restarted = False  # this is the restart its scrapes would find
        state.process_start_s = 0.0
        if kind == "added" or rid not in core.replicas:
            core.add_replica(rid, block_size=endpoint.block_size, num_gpu_blocks=endpoint.num_gpu_blocks,
                             scoring_cap=endpoint.scoring_cap)
        else:  # from the model: the initial version (WeightUpdater.rejoined catches it up)
            core.restarted(rid, num_gpu_blocks=endpoint.num_gpu_blocks, scoring_cap=endpoint.scoring_cap)
        core.set_health(rid, True)
        core.set_rotation(rid, None)
    elif kind in ("unhealthy", "restarting"):
        core.set_health(rid, False)
    elif kind == "healthy":
        if rid not in pool or not pool.get(rid).gone:  # else a new process: the scrape loop takes it
            core.set_health(rid, True)
    elif kind == "draining":
        core.set_rotation(rid, "draining")
    elif kind == "removed":
        core.remove_replica(rid, 0.0)
        pool.set_endpoints([s.endpoint for s in pool.states() if s.endpoint.replica_id != rid])
    if kind in ("restarting", "removed") and keys.PROBES in app:  # its answer would tell nothing now
        app[keys.PROBES].cancel(core, rid)
    if keys.METRICS in app:
        app[keys.METRICS].healthy.labels(rid).set(1 if rid in core.replicas and core.replicas[rid].healthy else 0)
        if kind == "removed":
            app[keys.METRICS].forget_replica(rid)
    subscriber = app.get(KV_EVENTS)
    if subscriber is not None:
        sync_watches(subscriber, [s.endpoint for s in pool.states() if s.endpoint.replica_id in core.replicas])
    if keys.LIFECYCLE in app:
        if kind in ("unhealthy", "restarting", "removed"):  # a hung engine would hold them until the timeout
            app[keys.LIFECYCLE].abandon(rid, f"replica {rid} {kind}{f': {event.reason}' if event.reason else ''}")
        app[keys.LIFECYCLE].rotation_changed()


def server_restarted(app: web.Application, rid: str) -> bool:
    """``rid``'s server answered a metrics scrape as a new process (``router.scrape.scrape_once``:
    another process start time, a scrape or request refused since its last answer, nothing
    listening on its port, or token counters that went back): restarted by something other than
    this router (a pod's restart policy, an operator), at the same URL. Taken as the restart it
    is (:func:`on_replica_event` ``restarted``: its KV cache, index entries and pins forgotten),
    then brought to the fleet's version before it takes work (``WeightUpdater.rejoined``;
    reloaded from the current version's folder whenever that is known, as it serves its own
    command line's model): else its answers named the version this router recorded for it
    before (a new user saw one serve its start-up weights under the fleet's version). A replica
    this router launched restarts through its replica set's events instead. Whether it was taken
    as restarted here."""
    replica_set = app.get(FLEET)
    if rid not in app[keys.CORE].replicas or rid not in app[keys.POOL] or (
            replica_set is not None and replica_set.launched(rid)):
        return False
    log.warning("replica %s: its server answers as a new process (restarted by something other than this router): "
                "its cache is empty and it serves its start-up weights; brought to the fleet's version before it "
                "takes work", rid)
    on_replica_event(app, ReplicaEvent("restarted", rid, app[keys.POOL].get(rid).endpoint,
                                       "its server restarted (not by this router)"))
    updater = app.get(keys.WEIGHT_UPDATER)
    if updater is not None:
        core = app[keys.CORE]
        if updater.steps.folder_of_version(core.versions.current) is not None:
            # it serves its own command line's model, which this router cannot see: the initial
            # version only by assumption (a fresh attacker's router, started with
            # --initial-weight-version 1 before servers on seed-0 models, named 1 for theirs);
            # with the fleet's folder known it is reloaded, whatever it serves
            core.version_loaded(rid, None)
        updater.rejoined(rid, "since its server restarted")
    return True


def _shared(app: web.Application):
    """The router's shared state (``router.state.redis_state.RedisState``), None without one."""
    return app[keys.LIFECYCLE].shared if keys.LIFECYCLE in app else None


async def _claim_index(app: web.Application, floor: int) -> int:
    """A new replica's index: ``floor`` (the replica set's own next one) without shared state,
    else one no router sharing it has used (NoSharedState, 503, while Redis is unreachable)."""
    shared = _shared(app)
    if shared is None:
        return floor
    try:
        return await shared.claim_replica_index(floor)
    except StateUnavailable as exc:
        raise NoSharedState(f"cannot add a replica while redis is unreachable: its id must be unique across "
                            f"the routers sharing state ({exc}); retry when it is back") from None


class NoSharedState(RouterError):
    """An id for a new replica needs the shared state, which is unreachable now (503)."""

    status = 503


_STOPPING: set = set()


def stop_owned(app: web.Application, fleet, rid) -> None:
    """Another router removed replica ``rid``, which this router's replica set holds: stop it
    (in the background; the removal itself is already followed here). Logged if it fails."""
    async def stop() -> None:
        try:
            if fleet.owns(rid):
                await fleet.remove(rid)
        except Exception as exc:  # noqa: BLE001 - a background task must say why it failed
            log.warning("replica %s: stopping it after another router removed it failed: %r", rid, exc)

    task = asyncio.get_running_loop().create_task(stop())
    _STOPPING.add(task)
    task.add_done_callback(_STOPPING.discard)


def _set_endpoint(pool, endpoint: ReplicaEndpoint) -> None:
    others = [s.endpoint for s in pool.states() if s.endpoint.replica_id != endpoint.replica_id]
    pool.set_endpoints(others + [endpoint])


def _fleet(request: web.Request):
    fleet = request.app.get(FLEET)
    if fleet is None:
        raise NoFleet("this router fronts a fixed list of replica URLs; start it with `rollout-router serve` "
                      "to add or remove replicas")
    return fleet


def out_of_rotation(app: web.Application) -> dict[str, str]:
    """Every replica out of rotation now, with why: held by the core (a weight update, a drain,
    a failed update: ``VersionBook.rotation``) or being restarted (:data:`RESTARTING`, which
    wins). The one view ``GET /health``, ``GET /admin/replicas`` and ``GET /admin/weights`` show."""
    return {**app[keys.CORE].versions.rotation, **app.get(RESTARTING, {})}


def replica_rows(app: web.Application) -> list[dict[str, Any]]:
    """Every replica as ``GET /health`` and ``GET /admin/replicas`` show it: its URL, health
    (``stalled``: its engine holds work and finishes no token, ``DecisionCore.stalled``;
    ``stalls``: stalls in a row with no token finished since, so a hung engine between two
    stalls, back on probation, shows non-zero; ``probing``: a probe of its idle engine is in
    flight, ``DecisionCore.probe_due``),
    rotation (out during a weight update, with the reason), requests in flight, KV cache usage,
    scoring cap and weight version."""
    core, pool, now = app[keys.CORE], app[keys.POOL], time.monotonic()
    out = out_of_rotation(app)
    rows = []
    for s in pool.states():
        rid = s.endpoint.replica_id
        rec = core.replicas.get(rid)
        rows.append({
            "replica": rid, "url": s.endpoint.base_url, "healthy": rec is not None and rec.healthy,
            "stalled": core.stalled(rid, now), "stalls": rec.stalls if rec is not None else 0,
            "probing": rec is not None and rec.probing,
            "in_flight": core.in_flight(rid),
            "kv_cache_usage": s.metrics.kv_cache_usage, "scoring_cap": s.endpoint.scoring_cap,
            "weight_version": core.versions.loaded.get(rid),
            "in_rotation": rid not in out, "out_of_rotation_reason": out.get(rid),
        })
    return rows


async def list_replicas(request: web.Request) -> web.Response:
    """GET /admin/replicas: every replica (:func:`replica_rows`)."""
    return web.json_response({"replicas": replica_rows(request.app)})


async def add_replica(request: web.Request) -> web.Response:
    """POST /admin/replicas ``{}`` (start one from the config) or ``{"url": "http://..."}`` (register).

    A URL is taken in its canonical spelling (``replicas.addresses``) and refused (400, ``url``)
    when it reaches a server already a replica of this router, or one being added now here or,
    with shared state, through another router, however spelled (``localhost`` or ``127.0.0.1``,
    a trailing slash): one engine must not count twice. Any other field is a 400 naming it (a
    misspelt ``url`` launched a replica). The add runs as a task the app owns, awaited shielded:
    a client that leaves mid-launch stops only its wait, and the replica still joins (it was
    left running outside the fleet: unsupervised, unrouted, holding its memory)."""
    body = load_json_object(body_of(request)) if request.body_exists else {}
    unknown = sorted(set(body) - {"url"})
    if unknown:
        raise BadRequest(f"unknown field {echo(unknown[0])}: the body is {{}} (launch a replica from the config) "
                         "or {\"url\": \"http://...\"} (register a running vLLM server)", param=unknown[0])
    url = body.get("url")
    if url is not None:
        if not isinstance(url, str):
            raise BadRequest("'url' must be an http(s) URL of a running vLLM server", param="url")
        try:
            url = canonical_url(url)
        except ValueError as exc:
            raise BadRequest(f"'url' {exc}", param="url") from None
    fleet = _fleet(request)
    if url is None and fleet.cfg.urls:
        raise BadRequest("this router fronts servers given by replicas.urls: it launches none; "
                         "register a running server with {\"url\": \"http://...\"}", param="url")
    tasks, left = request.app[ADD_TASKS], []
    task = asyncio.ensure_future(_add(request.app, fleet, url))
    tasks.add(task)
    task.add_done_callback(lambda t: _add_done(tasks, t, url, bool(left)))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        left.append(True)  # the client went: the add goes on, and says how it ended in the log
        raise


def _add_done(tasks: set, task: asyncio.Task, url: str | None, client_left: bool) -> None:
    """Forget an add that ended; its error is retrieved here (not left to the garbage collector)
    and, when its client had left, logged: nobody else would hear of it."""
    tasks.discard(task)
    error = None if task.cancelled() else task.exception()
    if client_left:
        log.warning("POST /admin/replicas %s, whose client left, %s", echo(url) if url is not None else "{}",
                    f"failed: {error}" if error is not None else "ended" if task.cancelled() else "succeeded")


async def _add(app: web.Application, fleet, url: str | None) -> web.Response:
    """:func:`add_replica`'s work once its body is read: claim the address, add, answer."""
    claim = await _claim_address(app, url) if url is not None else None
    shared, held, added = _shared(app), None, False
    try:
        if claim is not None and shared is not None:  # and no other router is adding it now
            addresses = sorted(f"{ip}:{port}{path}" for ip, port, path in claim)
            try:
                if not await shared.claim_server(addresses, ADD_HOLD_S):
                    raise BadRequest(f"{echo(url)} is being added through another router", param="url")
            except StateUnavailable as exc:
                raise NoSharedState(f"cannot add a replica while redis is unreachable ({exc}); retry when it is back") from None
            held = addresses  # ours to let go of (not another router's, when the claim failed)
        endpoint = await fleet.add(url, model=app[keys.POOL].model)
        added = True
    except StartupError as exc:  # unreachable, or a block size or model the fleet does not share
        raise BadRequest(f"cannot add the replica: {exc}", param="url" if url is not None else "body") from exc
    finally:
        if claim is not None:
            app[ADDING].discard(claim)
        if held is not None:
            await shared.release_server(held, added)
    await app[FLEET].events.flush()  # the router follows it before answering
    answer = {"replica": endpoint.replica_id, "url": endpoint.base_url}
    if url is not None and await app[keys.WEIGHT_UPDATER].hold_paused([endpoint.replica_id]):
        answer["out_of_rotation_reason"] = app[keys.CORE].versions.rotation.get(endpoint.replica_id)
    return web.json_response(answer, status=201)


async def _claim_address(app: web.Application, url: str):
    """Resolve ``url`` and hold its address while it is added; BadRequest (``url``) when it does
    not resolve, or reaches a replica of this router or a server being added."""
    try:
        address = await resolve(url)
    except OSError as exc:
        raise BadRequest(f"cannot add the replica: {echo(url)} does not resolve ({exc})", param="url") from None
    if any((ip, port) in app[keys.OWN_ADDRESSES] for ip, port, _ in address):  # requests would loop through it
        raise BadRequest(f"{echo(url)} is this router itself: a replica must be a vLLM server", param="url")
    registry = getattr(_shared(app), "registry", None)  # with Redis: the entries it does not follow too
    elsewhere = registry.servers_elsewhere() if registry is not None else {}
    known = {}
    for base_url in [*(s.endpoint.base_url for s in list(app[keys.POOL].states())), *elsewhere]:
        try:
            known[base_url] = await resolve(base_url)
        except OSError:  # a replica's name that no longer resolves: compare its spelling
            known[base_url] = frozenset()
        if base_url == url:
            known[url] = address
    adding = app[ADDING]  # checked and claimed with no await in between
    twin = next((u for u, a in known.items() if a & address), None)
    if twin in elsewhere:
        raise BadRequest(f"{echo(url)} is already {elsewhere[twin]} of another router (as {echo(twin)}), which this "
                         "router does not route to", param="url")
    if twin is not None:
        raise BadRequest(f"{echo(url)} is already a replica of this router (as {echo(twin)})", param="url")
    if any(a & address for a in adding):
        raise BadRequest(f"{echo(url)} is being added already (another request)", param="url")
    adding.add(address)
    return address


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

    fleet, shared = _fleet(request), _shared(request.app)

    async def idle() -> bool:  # nothing in flight there here, nor on any other router
        return core.in_flight(rid) == 0 and (shared is None or await shared.drained_everywhere(rid))

    if fleet.owns(rid):
        try:
            drained = await fleet.remove(rid, drain_timeout_s=drain_s, idle=idle)
        except KeyError:  # a DELETE of it is under way already (or it just left)
            raise BadRequest(f"replica {echo(rid)!r} is being removed already", param="replica_id") from None
        await fleet.events.flush()
    else:  # added through another router: drain and drop it here, its owner stops it on reading that
        drained = await _remove_elsewhere(request.app, rid, drain_s, idle)
    return web.json_response({"replica": rid, "removed": True, "drained": drained})


async def _remove_elsewhere(app: web.Application, rid, drain_s: float | None, idle) -> bool:
    """Remove replica ``rid`` that another router's replica set holds (shared state): publish
    ``draining`` and wait up to ``drain_s`` until it is idle everywhere, then drop it here and
    publish ``removed`` at once; the router holding it stops it when it reads that
    (``RegistrySync._apply``). BadRequest without shared state (no other router to hold it)."""
    shared = _shared(app)
    if shared is None:
        raise BadRequest(f"replica {echo(rid)!r} is not one this router's replica set holds", param="replica_id")
    endpoint = app[keys.POOL].get(rid).endpoint
    drained = True
    if drain_s is not None:
        on_replica_event(app, ReplicaEvent("draining", rid, endpoint, f"drain within {drain_s:g} s"))
        drained = await poll_until(idle, drain_s, f"drain of {rid}")
    if rid in app[keys.CORE].replicas:
        on_replica_event(app, ReplicaEvent("removed", rid, endpoint, "removed" if drained else "drain timed out"))
    await shared.push_registry()
    return drained
