"""Router-added latency: sequential token-ID prompts through one zero-cost replica, minus direct.

Each of ``n`` distinct prompts (``tokens`` IDs, seeded) is sent twice in a row, directly to the
replica and through the router (alternating which goes first), on warm keep-alive connections, one
request at a time. Added latency = percentile(routed) - percentile(direct), p50 and p99, in ms;
interleaving cancels drift in the machine's speed. Bodies are serialized once, before timing.
With the router's ``pid``, also the router's CPU time (user + system, and user alone; all its
threads, from ``/proc/<pid>/stat``) per routed request over the timed requests.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

import aiohttp
import numpy as np

from bench.h2h.drive import VOCAB_HI, VOCAB_LO
from bench.h2h.routers import RouterSpec


def pct(xs: list[float], q: float) -> float:
    """The ``q``-th percentile (numpy's linear interpolation)."""
    return float(np.percentile(np.asarray(xs), q))


async def _post(http: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str]) -> float:
    t = time.perf_counter()
    async with http.post(url, data=body, headers=headers) as r:
        await r.read()
        if r.status != 200:
            raise RuntimeError(f"{url} answered {r.status}")
    return time.perf_counter() - t


def cpu_s(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of process ``pid`` so far (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


async def measure(spec: RouterSpec, router_url: str, replica_url: str, n: int, tokens: int, seed: int,
                  warmup: int = 50, on_request: Callable[[], None] = lambda: None, pid: int | None = None) -> dict:
    """Added latency of ``spec`` at ``router_url`` over ``replica_url``; raises on any non-200."""
    rng = np.random.default_rng(seed)
    ct = {"Content-Type": "application/json"}
    direct, routed = [], []
    cpu0 = (0.0, 0.0)
    conn = aiohttp.TCPConnector(limit=4, force_close=False)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=30)) as http:
        for i in range(-warmup, n):
            if i == 0 and pid is not None:
                cpu0 = cpu_s(pid)
            ids = rng.integers(VOCAB_LO, VOCAB_HI, tokens).tolist()
            d_body = json.dumps({"model": "sim-model", "prompt": ids, "max_tokens": 1}).encode()
            r_body = json.dumps({"model": "sim-model", "prompt": spec.prompt(ids), "max_tokens": 1}).encode()
            headers = {**ct, **spec.headers(None, f"lat-{i}")}
            pair = [("d", replica_url, d_body, ct), ("r", router_url, r_body, headers)]
            for which, url, body, h in (pair if i % 2 == 0 else pair[::-1]):
                dt = await _post(http, url + "/v1/completions", body, h)
                if i >= 0:
                    (direct if which == "d" else routed).append(dt)
            if i >= 0:
                on_request()
    ms = 1000.0
    cpu = {}
    if pid is not None:  # user: the router's own code; system: mostly the loopback TCP path its sends run
        user, system = (b - a for a, b in zip(cpu0, cpu_s(pid)))
        cpu = {"router_cpu_ms_per_request": (user + system) / n * ms, "router_user_ms_per_request": user / n * ms}
    return {**cpu, "n": n, "tokens": tokens, "direct_p50_ms": pct(direct, 50) * ms, "direct_p99_ms": pct(direct, 99) * ms,
            "routed_p50_ms": pct(routed, 50) * ms, "routed_p99_ms": pct(routed, 99) * ms,
            "added_p50_ms": (pct(routed, 50) - pct(direct, 50)) * ms,
            "added_p99_ms": (pct(routed, 99) - pct(direct, 99)) * ms}
