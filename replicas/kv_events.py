"""Where a vLLM replica publishes its KV cache events, and how to ask it.

Each replica we launch publishes with ``--kv-events-config`` (``replicas.server.kv_events_args``):
a ZMQ PUB socket and a replay ROUTER socket, both bound by the engine on OS-chosen ports of
``VLLM_HOST_IP`` (the replica's host), so no port can be lost between choosing and binding.
vLLM binds only wildcard endpoints (``ZmqEventPublisher._is_bind_endpoint``: a
``tcp://127.0.0.1:N`` endpoint would make the publisher *connect*), and ``tcp://*:0`` binds
``get_ip()``, i.e. ``VLLM_HOST_IP``. The bound addresses are read back from the server's
``GET /kv_event_sources`` (vLLM 0.32: ``{dp_rank: KVEventsConfig}``), which also works for
replicas we only wrap (``ReplicaSetConfig.urls``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import aiohttp

TOPIC = "kv-events"
"""ZMQ topic our replicas publish on."""


@dataclass(frozen=True)
class KvEventSource:
    """One replica's KV event publisher: PUB ``endpoint``, replay ``replay_endpoint``, ``topic``."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


def parse_sources(payload: Any) -> KvEventSource | None:
    """The data-parallel rank 0 publisher in a ``/kv_event_sources`` answer, or ``None`` when
    the replica publishes no events (empty answer, ``publisher`` null, events disabled)."""
    if not isinstance(payload, dict) or not payload:
        return None
    rank0 = payload.get("0", payload.get(0, next(iter(payload.values()))))
    if not isinstance(rank0, dict) or not rank0.get("enable_kv_cache_events") or rank0.get("publisher") != "zmq":
        return None
    endpoint = rank0.get("endpoint")
    if not isinstance(endpoint, str) or "*" in endpoint:
        return None  # not a connectable address
    replay = rank0.get("replay_endpoint")
    return KvEventSource(endpoint, replay if isinstance(replay, str) and "*" not in replay else None,
                         str(rank0.get("topic") or ""))


async def fetch_source(session: aiohttp.ClientSession, base_url: str, timeout_s: float = 10.0) -> KvEventSource | None:
    """``GET /kv_event_sources`` of the replica at ``base_url``; ``None`` if it has none or
    does not answer (an older vLLM, a fake server) within ``timeout_s``."""
    try:
        async with session.get(f"{base_url}/kv_event_sources",
                               timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                return None
            return parse_sources(await resp.json(content_type=None))
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None
