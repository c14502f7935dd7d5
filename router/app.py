"""The app factory: routes, middleware and cleanup contexts; nothing else."""

from __future__ import annotations

import asyncio
import contextlib
import random
from typing import AsyncIterator, Sequence

import aiohttp
from aiohttp import web

from cache_policy.policy import make_policy
from replicas.replica_set import ReplicaEndpoint
from router import handlers, keys, score
from router.config import AppConfig
from router.dispatch import Dispatcher
from router.errors import error_middleware
from router.metrics import RouterMetrics
from router.pool import ReplicaPool
from router.scrape import scrape_loop
from router.tokenize import PromptTokenizer


def create_app(cfg: AppConfig, endpoints: Sequence[ReplicaEndpoint], tokenizer: PromptTokenizer) -> web.Application:
    """Build the router app for ``endpoints``. ``tokenizer`` must be the replicas' model's."""
    app = web.Application(middlewares=[error_middleware], client_max_size=64 * 1024 * 1024)
    app[keys.CONFIG] = cfg
    app[keys.POOL] = ReplicaPool(endpoints)
    app[keys.METRICS] = RouterMetrics()
    app[keys.TOKENIZER] = tokenizer
    app.cleanup_ctx.extend([_http_session, _scraper])
    app.router.add_post("/v1/completions", handlers.completions)
    app.router.add_post("/v1/chat/completions", handlers.chat_completions)
    app.router.add_post("/v1/score", score.score)
    app.router.add_get("/v1/models", handlers.models)
    app.router.add_get("/health", handlers.health)
    app.router.add_get("/metrics", app[keys.METRICS].handle)
    return app


async def _http_session(app: web.Application) -> AsyncIterator[None]:
    """The one ClientSession to the replicas, and the dispatcher that uses it."""
    cfg = app[keys.CONFIG]
    timeout = aiohttp.ClientTimeout(total=cfg.router.request_timeout_s, sock_connect=5)
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        app[keys.HTTP] = http
        policy = make_policy(cfg.router.policy, cfg.policy, random.Random(cfg.router.seed))
        policy.on_replicas_changed(app[keys.POOL].ids())
        app[keys.DISPATCHER] = Dispatcher(cfg.router, app[keys.POOL], policy, app[keys.METRICS], http)
        yield


async def _scraper(app: web.Application) -> AsyncIterator[None]:
    interval = app[keys.CONFIG].router.scrape_interval_s
    if interval <= 0:
        yield
        return
    task = asyncio.create_task(scrape_loop(app[keys.HTTP], app[keys.POOL], app[keys.METRICS], interval))
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
