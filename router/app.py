"""The app factory: routes, middleware and cleanup contexts; nothing else."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import AsyncIterator, Sequence

import aiohttp
from aiohttp import web

from cache_policy.core import DecisionCore
from replicas.auth import PROCESS_KEYS
from replicas.replica_set import ReplicaEndpoint
from router import admin, fleet, handlers, keys, score
from router.busy_poll import BusyPoll
from router.config import AppConfig
from router.edge import edge_middleware
from router.errors import error_middleware
from router.fastlane import FAST_PATH
from router.kv_events import KV_EVENTS, kv_events_ctx
from router.lifecycle import Lifecycle
from router.metrics import RouterMetrics, metrics_middleware
from router.parse import Limits
from router.pool import ReplicaPool
from router.scrape import EngineProbes, ScrapeRounds, load_of
from router.shutdown import SHUTDOWN
from router.state import make_state
from router.state.sync import state_sync_ctx
from router.tokenize import PromptTokenizer
from router.upstream import ReplicaClient


log = logging.getLogger(__name__)


def make_core(cfg: AppConfig, endpoints: Sequence[ReplicaEndpoint]) -> DecisionCore:
    """The decision core for ``cfg``, with ``endpoints`` as its replicas. ValueError when the
    replicas disagree on the KV block size."""
    r = cfg.router
    core = DecisionCore(cfg.policy, policy=r.policy, seed=r.seed, weight_update_policy=r.weight_update_policy,
                        initial_version=r.initial_weight_version, admission=r.admission)
    for ep in endpoints:
        core.add_replica(ep.replica_id, block_size=ep.block_size, num_gpu_blocks=ep.num_gpu_blocks,
                         scoring_cap=ep.scoring_cap)
    return core


def create_app(cfg: AppConfig, endpoints: Sequence[ReplicaEndpoint], tokenizer: PromptTokenizer) -> web.Application:
    """Build the router app for ``endpoints``. ``tokenizer`` must be the replicas' model's."""
    metrics = RouterMetrics()
    busy_poll = BusyPoll(cfg.router.busy_poll_ms / 1e3, metrics.busy_poll.inc) if cfg.router.busy_poll_ms else None
    app = web.Application(middlewares=[metrics_middleware(metrics, busy_poll), error_middleware, edge_middleware(cfg)],
                          client_max_size=cfg.router.max_body_bytes)
    if busy_poll is not None:
        metrics.before_scrape.append(busy_poll.count_now)
        app.on_shutdown.append(lambda _: _stop_polling(busy_poll))
    app[keys.CONFIG] = cfg
    app[keys.LIMITS] = Limits.of(cfg, endpoints)
    app[keys.POOL] = ReplicaPool(endpoints)
    app[keys.METRICS] = metrics
    app[keys.TOKENIZER] = tokenizer
    app[keys.CORE] = make_core(cfg, endpoints)
    metrics.replicas = app[keys.CORE].replicas
    app.cleanup_ctx.extend([_http_session, _scraper, kv_events_ctx, state_sync_ctx])
    app.router.add_post(FAST_PATH, handlers.completions)
    app[keys.OWN_ADDRESSES] = set()  # filled once the router listens (router.server.running_router)
    app[keys.FAST_HANDLER] = handlers.completions  # the same handler, when router.fastlane serves it
    app.router.add_post("/v1/chat/completions", handlers.chat_completions)
    app.router.add_post("/v1/score", score.score)
    app.router.add_get("/v1/models", handlers.models)
    app.router.add_get("/health", handlers.health)
    app.router.add_get("/openapi.json", handlers.openapi)
    app.router.add_delete("/v1/sessions/{session_id}", handlers.end_session)
    app.router.add_get("/metrics", app[keys.METRICS].handle)
    app.router.add_post("/admin/weights", admin.post_weights)
    app.router.add_get("/admin/weights", admin.get_weights)
    app.router.add_post("/admin/weights/begin", admin.post_begin)
    app.router.add_post("/admin/weights/commit", admin.post_commit)
    app.router.add_post("/admin/weights/abort", admin.post_abort)
    app.router.add_get("/admin/replicas", fleet.list_replicas)
    app.router.add_post("/admin/replicas", fleet.add_replica)
    app.router.add_delete("/admin/replicas/{replica_id}", fleet.remove_replica)
    return app


async def _http_session(app: web.Application) -> AsyncIterator[None]:
    """The one ClientSession to the replicas, and the request lifecycle that uses it."""
    cfg = app[keys.CONFIG]
    timeout = aiohttp.ClientTimeout(total=cfg.router.request_timeout_s, sock_connect=5)
    # vLLM's server closes idle keep-alive connections after 5 s: drop ours sooner, so a
    # pooled connection is never reused just as the server closes it.
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=3)
    state = make_state(cfg.router.state, cfg.router.redis_url, cfg.router)
    # PROCESS_KEYS: each replica's key on every call to it (replicas.auth; replicas refuse calls without it)
    # non-streamed completions and scoring rows: the lean client, on the same timeouts
    upstream = ReplicaClient(timeout_s=cfg.router.request_timeout_s, connect_timeout_s=5, idle_s=3)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector, middlewares=(PROCESS_KEYS,)) as http:
        app[keys.HTTP] = http
        app[keys.LIFECYCLE] = Lifecycle(cfg.router, app[keys.CORE], app[keys.POOL], app[keys.METRICS], http,
                                        shared=state, upstream=upstream)
        app[keys.WEIGHT_UPDATER] = updater = admin.make_updater(cfg, app[keys.LIFECYCLE])
        updater.restart_engine = getattr(app.get(fleet.FLEET), "engine_stalled", None)
        await updater.hold_paused()
        if SHUTDOWN in app:  # a stopping router answers queued requests 503 + Retry-After at once
            app[SHUTDOWN].on_drain.append(app[keys.LIFECYCLE].refuse_queued)
        try:
            yield
        finally:
            await app[keys.WEIGHT_UPDATER].close()  # an update in progress ends (or rolls back) first
            await state.close()
            await upstream.close()


def _restart_hung(app: web.Application, core, now: float, said: dict[str, int]) -> None:
    """Ask the replica set's supervisor to restart each replica whose engine stalled
    ``policy.stall_restart_after`` times in a row (``DecisionCore.restart_due``); said once per
    restart begun. Replicas the set did not launch (``replicas.urls``) stay out, as
    ``DecisionCore.stalled`` has them: said once per stall count (``said``: replica -> the count
    last said), so their operator knows to restart them."""
    replica_set = app.get(fleet.FLEET)
    for rid in list(core.replicas):
        if not core.restart_due(rid, now):
            continue
        stalls = core.replicas[rid].stalls
        if replica_set is not None and replica_set.launched(rid):
            # False: a restart is under way already (the supervisor's events say so), or supervision is off
            if replica_set.engine_stalled(rid, f"its engine stalled {stalls} times in a row (no token finished "
                                               f"for policy.stall_timeout_s={core.cfg.stall_timeout_s:g} s while "
                                               "it held work)"):
                log.warning("replica %s: its engine stalled %d times in a row: restarting it", rid, stalls)
        elif said.get(rid) != stalls:
            said[rid] = stalls
            log.warning("replica %s: its engine stalled %d times in a row, but this router cannot restart it "
                        "(not launched by it: replicas.urls): it stays out, probed at each stall's end; restart "
                        "its server", rid, stalls)


async def _stop_polling(busy_poll: BusyPoll) -> None:
    busy_poll.close()


def endpoints_of(app: web.Application) -> list[ReplicaEndpoint]:
    return [s.endpoint for s in app[keys.POOL].states()]


async def _scraper(app: web.Application) -> AsyncIterator[None]:
    interval = app[keys.CONFIG].router.scrape_interval_s
    if interval <= 0:
        yield
        return
    rounds, probes = ScrapeRounds(), EngineProbes()
    app[keys.PROBES] = probes
    task = asyncio.create_task(_scrape_loop(app, interval, rounds, probes))
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await rounds.close()
    await probes.close()


async def _scrape_loop(app: web.Application, interval_s: float, rounds: ScrapeRounds, probes: EngineProbes) -> None:
    """Scrape every replica each ``interval_s`` seconds; each round wakes the admission queue.
    Survives anything one replica or one round throws (logged once per cause); a replica that
    hangs holds up no round (``ScrapeRounds``). A replica a round took out of rotation because
    its scrapes got no answer in time (hung, not one answering errors) has its requests in flight
    run elsewhere (``Lifecycle.abandon``); one whose engine stalled ``policy.stall_restart_after``
    times in a row is restarted (:func:`_restart_hung`); an idle engine that finished no token for
    ``policy.stall_probe_after_s`` is probed (``router.scrape.EngineProbes``), so one hung while
    idle stalls on the probe, not on a client's request."""
    probe_timeout_s = app[keys.CONFIG].router.request_timeout_s
    http, pool, metrics, core = app[keys.HTTP], app[keys.POOL], app[keys.METRICS], app[keys.CORE]
    seen: set[str] = set()
    said_hung: dict[str, int] = {}
    while True:
        started = time.monotonic()
        results = await rounds.run(http, pool, core, metrics, started, wait_s=interval_s)
        # each scrape that took a replica out as silent, whichever round it finished in (one that
        # finished between rounds was missed by a healthy-before / unhealthy-after comparison)
        for state in list(pool.states()):
            rid = state.endpoint.replica_id
            if state.went_silent:
                state.went_silent = False
                if rid in core.replicas and not core.replicas[rid].healthy:
                    why = "its engine stalled" if core.stalled(rid, time.monotonic()) else \
                        "it stopped answering its metrics scrapes"
                    app[keys.LIFECYCLE].abandon(rid, f"replica {rid}: {why}")
            if state.restarted:
                state.restarted = False
                if fleet.server_restarted(app, rid):
                    core.observe_load(rid, load_of(state.metrics), started)  # the scrape that found it
        for exc in results:
            if isinstance(exc, Exception) and repr(type(exc)) not in seen:
                seen.add(repr(type(exc)))
                log.warning("metrics scrape failed unexpectedly (logged once per cause): %r", exc)
        try:
            _restart_hung(app, core, started, said_hung)
            probes.start_due(http, pool, core, metrics, started, probe_timeout_s, interval_s)
            updater = app.get(keys.WEIGHT_UPDATER)
            if updater is not None:
                updater.catch_up_recovered(time.monotonic())
            app[keys.LIFECYCLE].pump()
            metrics.publish_replicas(core, pool)
            metrics.publish_state({**core.state_sizes(), **app[keys.LIFECYCLE].state_sizes()})
            subscriber = app.get(KV_EVENTS)
            if subscriber is not None:
                metrics.publish_kv_events(subscriber.snapshot())
        except Exception as exc:  # noqa: BLE001 - the loop must outlive one bad round
            if repr(type(exc)) not in seen:
                seen.add(repr(type(exc)))
                log.exception("scrape round failed (logged once per cause): %r", exc)
        await asyncio.sleep(interval_s)
