"""Background loop scraping each replica's /metrics into the pool (health + KV usage).

Owned by the app's cleanup context; cancelled at shutdown; an interval of 0 disables it.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from router.metrics import RouterMetrics
from router.pool import ReplicaPool, ReplicaState
from replicas.metrics import parse_vllm_metrics

log = logging.getLogger(__name__)


async def scrape_once(http: aiohttp.ClientSession, state: ReplicaState, metrics: RouterMetrics) -> None:
    """Fetch one replica's metrics; a failure takes it out of rotation until it answers again."""
    rid = state.endpoint.replica_id
    try:
        async with http.get(state.endpoint.base_url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as r:
            r.raise_for_status()
            text = await r.text()
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        if state.healthy:
            log.warning("replica %s failed its metrics scrape, out of rotation: %r", rid, exc)
        state.healthy = False
    else:
        state.metrics = parse_vllm_metrics(text)
        state.healthy = True
        metrics.kv_usage.labels(rid).set(state.metrics.kv_cache_usage)
    metrics.healthy.labels(rid).set(1 if state.healthy else 0)


async def scrape_loop(http: aiohttp.ClientSession, pool: ReplicaPool, metrics: RouterMetrics,
                      interval_s: float) -> None:
    """Scrape all replicas every ``interval_s`` seconds until cancelled."""
    while True:
        await asyncio.gather(*(scrape_once(http, s, metrics) for s in list(pool.states())))
        await asyncio.sleep(interval_s)
