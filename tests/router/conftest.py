"""A router in front of the session's two real vLLM replicas (``replica_set`` fixture)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import aiohttp
import pytest_asyncio
from aiohttp import web

from router.config import AppConfig
from router.server import running_router


@dataclass
class RouterHandle:
    url: str
    app: web.Application
    http: aiohttp.ClientSession


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def router(replica_set):
    """The default prefix-affinity router on a free loopback port, shared by the session."""
    cfg = AppConfig().replace(router={"port": 0, "scrape_interval_s": 0.5})
    async with running_router(cfg, replica_set.endpoints) as (url, app):
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
            yield RouterHandle(url, app, http)


def unique_prompt(seed: int, n: int, vocab: int = 1000) -> list[int]:
    """``n`` ordinary token IDs, distinct per seed so tests never hit each other's blocks."""
    rng = random.Random(1_000_003 * seed + n)
    return [rng.randrange(8, vocab) for _ in range(n)]
