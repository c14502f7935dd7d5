"""Background loop scraping each replica's /metrics and telling the decision core (health + load).

Owned by the app's cleanup context; cancelled at shutdown; an interval of 0 disables it.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from cache_policy.core import DecisionCore, ReplicaLoad
from router.metrics import RouterMetrics
from router.pool import ReplicaState
from replicas.metrics import parse_vllm_metrics

log = logging.getLogger(__name__)


SCRAPE_TIMEOUT_S = 10.0
FAILURES_OUT_OF_ROTATION = 3
"""A busy replica on a loaded host can miss one scrape; a refused connection counts at once."""


async def scrape_once(http: aiohttp.ClientSession, state: ReplicaState, core: DecisionCore,
                      metrics: RouterMetrics, started_at: float) -> None:
    """Fetch one replica's metrics into ``state`` and the core. A refused connection, or
    ``FAILURES_OUT_OF_ROTATION`` failed scrapes in a row, mark it unhealthy until it answers again."""
    rid = state.endpoint.replica_id
    timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)
    healthy = core.replicas[rid].healthy if rid in core.replicas else True
    try:
        async with http.get(state.endpoint.base_url + "/metrics", timeout=timeout) as r:
            r.raise_for_status()
            m = parse_vllm_metrics(await r.text())
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:  # ValueError: not Prometheus text
        state.scrape_failures += 1
        refused = isinstance(exc, aiohttp.ClientConnectorError)
        if healthy and (refused or state.scrape_failures >= FAILURES_OUT_OF_ROTATION):
            log.warning("replica %s failed %d metrics scrape(s), out of rotation: %r", rid, state.scrape_failures, exc)
            core.set_health(rid, False)
    else:
        state.metrics = m
        state.scrape_failures = 0
        core.set_health(rid, True)
        core.observe_load(rid, ReplicaLoad(m.kv_cache_usage, m.num_running, m.num_waiting, m.num_gpu_blocks,
                                           m.num_preemptions), started_at)
        metrics.kv_usage.labels(rid).set(m.kv_cache_usage)
    metrics.healthy.labels(rid).set(1 if rid in core.replicas and core.replicas[rid].healthy else 0)
