"""The app factory: routes, middleware and cleanup contexts; nothing else."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from typing import AsyncIterator, Sequence

import aiohttp
from aiohttp import web

from cache_policy.policy import make_policy
from replicas.replica_set import ReplicaEndpoint
from router import admin, handlers, keys, score
from router.admission import AdmissionController
from router.config import AppConfig
from router.dispatch import Dispatcher
from router.errors import error_middleware
from router.metrics import RouterMetrics, metrics_middleware
from router.pool import ReplicaPool
from router.scrape import scrape_once
from router.shared_state import make_state
from router.tokenize import PromptTokenizer
from router.versions import WeightVersions


def create_app(cfg: AppConfig, endpoints: Sequence[ReplicaEndpoint], tokenizer: PromptTokenizer) -> web.Application:
    """Build the router app for ``endpoints``. ``tokenizer`` must be the replicas' model's."""
    metrics = RouterMetrics()
    app = web.Application(middlewares=[metrics_middleware(metrics), error_middleware],
                          client_max_size=64 * 1024 * 1024)
    app[keys.CONFIG] = cfg
    app[keys.POOL] = ReplicaPool(endpoints)
    app[keys.METRICS] = metrics
    app[keys.TOKENIZER] = tokenizer
    app[keys.VERSIONS] = WeightVersions(app[keys.POOL], cfg.router.weight_update_policy,
                                        cfg.router.initial_weight_version, cfg.policy)
    app[keys.ADMISSION] = AdmissionController(cfg.policy, app[keys.POOL], app[keys.METRICS].registry,
                                              enabled=cfg.router.admission)
    app.cleanup_ctx.extend([_http_session, _scraper])
    app.router.add_post("/v1/completions", handlers.completions)
    app.router.add_post("/v1/chat/completions", handlers.chat_completions)
    app.router.add_post("/v1/score", score.score)
    app.router.add_get("/v1/models", handlers.models)
    app.router.add_get("/health", handlers.health)
    app.router.add_get("/metrics", app[keys.METRICS].handle)
    app.router.add_post("/admin/weights", admin.post_weights)
    app.router.add_get("/admin/weights", admin.get_weights)
    return app


async def _http_session(app: web.Application) -> AsyncIterator[None]:
    """The one ClientSession to the replicas, and the dispatcher that uses it."""
    cfg = app[keys.CONFIG]
    timeout = aiohttp.ClientTimeout(total=cfg.router.request_timeout_s, sock_connect=5)
    # vLLM's server closes idle keep-alive connections after 5 s: drop ours sooner, so a
    # pooled connection is never reused just as the server closes it.
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=3)
    state = make_state(cfg.router.state, cfg.router.redis_url)
    await state.register(list(endpoints_of(app)))
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        app[keys.HTTP] = http
        policy = make_policy(cfg.router.policy, cfg.policy, random.Random(cfg.router.seed))
        policy.on_replicas_changed(app[keys.POOL].ids())
        app[keys.DISPATCHER] = Dispatcher(cfg.router, app[keys.POOL], policy, app[keys.METRICS], http,
                                          admission=app[keys.ADMISSION], versions=app[keys.VERSIONS],
                                          shared=state)
        app[keys.WEIGHT_UPDATER] = admin.WeightUpdater(cfg, app[keys.DISPATCHER])
        try:
            yield
        finally:
            await state.close()


def endpoints_of(app: web.Application) -> list[ReplicaEndpoint]:
    return [s.endpoint for s in app[keys.POOL].states()]


async def _scraper(app: web.Application) -> AsyncIterator[None]:
    interval = app[keys.CONFIG].router.scrape_interval_s
    if interval <= 0:
        yield
        return
    task = asyncio.create_task(_scrape_loop(app, interval))
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _scrape_loop(app: web.Application, interval_s: float) -> None:
    """Scrape every replica each ``interval_s`` seconds; each round wakes the admission queue."""
    http, pool, metrics, admission = app[keys.HTTP], app[keys.POOL], app[keys.METRICS], app[keys.ADMISSION]
    while True:
        started = time.monotonic()
        await asyncio.gather(*(scrape_once(http, s, metrics) for s in list(pool.states())))
        admission.on_scrape(started)
        await asyncio.sleep(interval_s)
