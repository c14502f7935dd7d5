"""Background loop scraping each replica's /metrics into the pool (health + KV usage).

Owned by the app's cleanup context; cancelled at shutdown; an interval of 0 disables it.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from router.metrics import RouterMetrics
from router.pool import ReplicaState
from replicas.metrics import parse_vllm_metrics

log = logging.getLogger(__name__)


SCRAPE_TIMEOUT_S = 10.0
FAILURES_OUT_OF_ROTATION = 3
"""A busy replica on a loaded host can miss one scrape; a refused connection counts at once."""


async def scrape_once(http: aiohttp.ClientSession, state: ReplicaState, metrics: RouterMetrics) -> None:
    """Fetch one replica's metrics. A refused connection, or ``FAILURES_OUT_OF_ROTATION`` failed
    scrapes in a row, take it out of rotation until it answers again."""
    rid = state.endpoint.replica_id
    timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)
    try:
        async with http.get(state.endpoint.base_url + "/metrics", timeout=timeout) as r:
            r.raise_for_status()
            text = await r.text()
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        state.scrape_failures += 1
        refused = isinstance(exc, aiohttp.ClientConnectorError)
        if state.healthy and (refused or state.scrape_failures >= FAILURES_OUT_OF_ROTATION):
            log.warning("replica %s failed %d metrics scrape(s), out of rotation: %r", rid, state.scrape_failures, exc)
            state.healthy = False
    else:
        state.metrics = parse_vllm_metrics(text)
        state.scrape_failures = 0
        state.healthy = True
        metrics.kv_usage.labels(rid).set(state.metrics.kv_cache_usage)
    metrics.healthy.labels(rid).set(1 if state.healthy else 0)
