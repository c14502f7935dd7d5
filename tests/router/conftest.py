"""A router in front of the session's two real vLLM replicas (``replica_set`` fixture)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from replicas.auth import PROCESS_KEYS
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
        # PROCESS_KEYS: the tests' direct calls to a replica (its /tokenize, /metrics) carry its key
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300), middlewares=(PROCESS_KEYS,)) as http:
            yield RouterHandle(url, app, http)


def unique_prompt(seed: int, n: int, vocab: int = 1000) -> list[int]:
    """``n`` ordinary token IDs, distinct per seed so tests never hit each other's blocks."""
    rng = random.Random(1_000_003 * seed + n)
    return [rng.randrange(8, vocab) for _ in range(n)]


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A real ``redis-server`` on a free loopback port for the session (installed by scripts/test.sh)."""
    import shutil
    import socket
    import subprocess
    import time

    binary = shutil.which("redis-server")
    assert binary, "redis-server is not installed: run scripts/test.sh, which installs it"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(timeout=10)
