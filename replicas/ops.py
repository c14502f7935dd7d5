"""Small async helpers over one replica's HTTP API.

Each takes the caller's ``aiohttp.ClientSession`` (one persistent session per owner, never one
per call) and the replica's base URL (``http://host:port``, no trailing slash). Each sends the
replica's key when this process holds it (``replicas.auth.PROCESS_KEYS``).
"""

from __future__ import annotations

import asyncio

import aiohttp

from replicas.auth import headers_for
from replicas.metrics import VllmMetrics, parse_vllm_metrics


async def fetch_metrics_text(session: aiohttp.ClientSession, base_url: str) -> str:
    """The raw Prometheus text of ``GET /metrics``; raises ``aiohttp.ClientError`` on failure."""
    async with session.get(f"{base_url}/metrics", headers=headers_for(base_url)) as resp:
        resp.raise_for_status()
        return await resp.text()


async def fetch_metrics(session: aiohttp.ClientSession, base_url: str) -> VllmMetrics:
    """``GET /metrics`` parsed into a :class:`VllmMetrics` snapshot."""
    return parse_vllm_metrics(await fetch_metrics_text(session, base_url))


async def reset_prefix_cache(
    session: aiohttp.ClientSession, base_url: str, *, reset_running_requests: bool = False
) -> bool:
    """``POST /reset_prefix_cache`` (needs ``VLLM_SERVER_DEV_MODE=1``).

    vLLM answers 200 ``{"success": bool}``: ``false`` while blocks are still held (running
    requests); retry later, or pass ``reset_running_requests=True`` to preempt them first.
    """
    params = {"reset_running_requests": "true"} if reset_running_requests else None
    async with session.post(f"{base_url}/reset_prefix_cache", params=params, headers=headers_for(base_url)) as resp:
        resp.raise_for_status()
        return bool((await resp.json()).get("success", False))


async def is_healthy(session: aiohttp.ClientSession, base_url: str) -> bool:
    """True iff ``GET /health`` answers 200; connection errors, timeouts and a URL aiohttp
    cannot use (``ValueError``, e.g. a host name IDNA refuses) read as False."""
    try:
        async with session.get(f"{base_url}/health") as resp:
            return resp.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return False
