"""One small-KV vLLM-CPU replica shared by the admission and weight-version tests.

128 KV blocks of 32 tokens (4,096 tokens), so a dozen sessions overload it; the weight tests
reload its weights in place. Started by the first test module that asks for it (about a
minute) and stopped when the last one that asked is torn down (both use session scope), so
the suite starts it once. ``ROLLOUT_ROUTER_SMALL_KV_URL`` names an already running server with
that shape to use instead (its weights get reloaded).

The weight-update modules take their ``small`` and ``http`` fixtures from
:func:`weight_test_fixtures`, each with its own scope for ``small``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from typing import Any, Literal

import aiohttp
import pytest_asyncio

from replicas.config import ReplicaSetConfig
from replicas.replica_set import ReplicaSet
from replicas.weights import update_weights

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


def weight_test_fixtures(scope: Literal["module", "session"], checkpoint: str) -> tuple[Any, Any]:
    """The fixtures ``small`` (``scope``: how long the module holds the shared replica) and ``http``
    (per test: a client session carrying the replica's key, after ``checkpoint`` was reloaded into
    the replica and its prefix cache emptied). A module binds them by name:
    ``small, http = weight_test_fixtures("module", CKPT[0])``."""

    @pytest_asyncio.fixture(scope=scope, loop_scope="session")
    async def small():
        async with small_replica() as replica_set:
            yield replica_set

    @pytest_asyncio.fixture(loop_scope="session")
    async def http(small):
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300), middlewares=(small.auth,)) as session:
            result = await update_weights(session, small.endpoints[0].base_url, checkpoint, reset_prefix_cache=True)
            assert result.ok, result
            yield session

    return small, http
