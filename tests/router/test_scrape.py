"""The metrics scrape loop outlives garbage from its replicas (issue 12).

A real router app scrapes five loopback targets every 0.1 s: one answers a real vLLM metrics page,
the others answer HTML, invalid UTF-8, nothing at all (a hang), or refuse the connection. The loop
must keep scraping the good one (a hang holds no round up), take the broken ones
out of rotation by the rule in ``router.scrape`` (refused: at once; else after
``FAILURES_OUT_OF_ROTATION`` failures in a row), and put each back once it answers properly.
"""

from __future__ import annotations

import asyncio
import re
import socket
import time

import pytest
from aiohttp import web

from cache_policy.types import ReplicaId
from replicas.replica_set import ReplicaEndpoint
from router import keys
from router.config import AppConfig
from router.scrape import FAILURES_OUT_OF_ROTATION, SCRAPE_TIMEOUT_S
from router.server import running_router
from tests.router.edge_fixtures import tiny_tokenizer
from tests.router.fake_vllm import metrics_page

pytestmark = pytest.mark.asyncio(loop_scope="function")

INTERVAL_S = 0.1
KV_USAGE = 0.375
"""The KV usage the good page reports (the captured page's value replaced)."""
GOOD_PAGE = re.sub(r"(vllm:kv_cache_usage_perc\{[^}]*\}) [0-9.e+-]+", rf"\1 {KV_USAGE}", metrics_page(32, 1000))
GARBAGE = {
    "html": (b"<!doctype html><html><body><h1>502 Bad Gateway</h1></body></html>", "text/html"),
    "utf8": (b"vllm:num_requests_running 1\n\xff\xfe\xc3\x28 not utf-8 \x80\x81\n", "text/plain"),
}


class Target:
    """One scrape target: answers ``mode`` (good | html | utf8 | hang) and counts its scrapes."""

    def __init__(self, mode: str) -> None:
        self.mode, self.scrapes = mode, 0
        self.release = asyncio.Event()

    async def metrics(self, _: web.Request) -> web.Response:
        self.scrapes += 1
        if self.mode == "hang":
            await self.release.wait()  # a wedged server: accepts, never answers until told
        if self.mode in GARBAGE:
            body, ctype = GARBAGE[self.mode]
            return web.Response(body=body, content_type=ctype)
        return web.Response(text=GOOD_PAGE, content_type="text/plain")


async def _serve(target: Target, port: int = 0) -> tuple[web.AppRunner, int]:
    app = web.Application()
    app.router.add_get("/metrics", target.metrics)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for: {what}"
        await asyncio.sleep(0.02)


async def test_html_bad_utf8_a_hang_and_a_refused_connection_do_not_stop_the_scrape_loop(caplog):
    targets = {name: Target(name) for name in ("good", "html", "utf8", "hang")}
    runners, endpoints = [], []
    for name, target in targets.items():
        runner, port = await _serve(target)
        runners.append(runner)
        endpoints.append(ReplicaEndpoint(ReplicaId(name), f"http://127.0.0.1:{port}", 32, 1000, "tiny-llama"))
    refused_port = _free_port()
    endpoints.append(ReplicaEndpoint(ReplicaId("refused"), f"http://127.0.0.1:{refused_port}", 32, 1000,
                                     "tiny-llama"))
    cfg = AppConfig().replace(router={"port": 0, "scrape_interval_s": INTERVAL_S, "kv_events": False})
    try:
        async with running_router(cfg, endpoints, tiny_tokenizer()) as (_, app):
            core = app[keys.CORE]
            healthy = lambda rid: core.replicas[ReplicaId(rid)].healthy  # noqa: E731
            await _until(lambda: not healthy("refused"), 5, "a refused connection takes its replica out at once")
            await _until(lambda: not healthy("html") and not healthy("utf8"), 8,
                         f"{FAILURES_OUT_OF_ROTATION} garbage answers in a row take a replica out")
            assert targets["html"].scrapes >= FAILURES_OUT_OF_ROTATION <= targets["utf8"].scrapes

            # the good replica keeps being scraped while the hang holds its one scrape (SCRAPE_TIMEOUT_S,
            # 10 s): without per-replica scrapes every round would wait those 10 s
            before = targets["good"].scrapes
            await _until(lambda: targets["good"].scrapes - before >= 5, 0.5 * SCRAPE_TIMEOUT_S,
                         "5 more scrapes of the good replica, well inside one hung scrape")
            assert healthy("good") and core.replicas[ReplicaId("good")].load.kv_cache_usage == KV_USAGE
            assert targets["hang"].scrapes <= 2  # one scrape per replica at a time, never a pile-up

            # every broken target comes back once it answers properly: the loop is alive
            for name in ("html", "utf8", "hang"):
                targets[name].mode = "good"
            targets["hang"].release.set()
            late = Target("good")
            runner, _ = await _serve(late, refused_port)
            runners.append(runner)
            await _until(lambda: all(healthy(r) for r in ("html", "utf8", "hang", "refused")), 8,
                         "every replica healthy again")
            for name in ("html", "utf8", "hang", "refused"):
                assert core.replicas[ReplicaId(name)].load.kv_cache_usage == KV_USAGE, name
            assert late.scrapes >= 1
    finally:
        for target in targets.values():
            target.release.set()
        for runner in runners:
            await runner.cleanup()
    logged = [r.getMessage() for r in caplog.records if "logged once per cause" in r.getMessage()]
    assert len(logged) == len(set(logged))  # once per cause, not once per round


async def test_replicas_that_went_idle_together_are_probed_a_round_apart_and_stay_apart():
    # a fresh attacker: every idle engine of one 2-core host got its probe in the same scrape
    # round (each took ~7 s there). A per-replica stretch of the period (session 28's first fix)
    # drifted two replicas back into one round after ~2.5 min (a new user). Now a round probes
    # at most idle_budget idle replicas, the longest idle first, and equal periods keep them apart
    from aiohttp import ClientSession

    from cache_policy.config import PolicyConfig
    from cache_policy.core import DecisionCore, ReplicaLoad
    from router.metrics import RouterMetrics
    from router.pool import ReplicaPool
    from router.scrape import EngineProbes, idle_budget
    from tests.router.fake_vllm import FakeVllm, serving

    assert (idle_budget(4, 1.0, 120.0), idle_budget(1024, 1.0, 120.0), idle_budget(3, 0.0, 120.0)) == (1, 9, 3)
    fakes = [FakeVllm(block_size=16) for _ in range(4)]
    async with serving(fakes[0]) as u0, serving(fakes[1]) as u1, serving(fakes[2]) as u2, serving(fakes[3]) as u3:
        eps = [ReplicaEndpoint(ReplicaId(f"replica-{i}"), url, 16, 2000, "fake-gpu-model")
               for i, url in enumerate((u0, u1, u2, u3))]
        core = DecisionCore(PolicyConfig(stall_timeout_s=60.0, stall_probe_after_s=120.0))
        for ep in eps:
            core.add_replica(ep.replica_id, block_size=16, num_gpu_blocks=2000)
            core.observe_load(ep.replica_id, ReplicaLoad(0.0, 0, 0, 2000, 0, 500), 0.0)  # idle together
        probes, rounds = EngineProbes(), {}
        async with ClientSession() as http:
            for t in range(0, 500):  # scrape rounds 1 s apart, all idle (counters still)
                for ep in eps:
                    core.observe_load(ep.replica_id, ReplicaLoad(0.0, 0, 0, 2000, 0, 500), float(t))
                for rid in probes.start_due(http, ReplicaPool(eps), core, RouterMetrics(), float(t), 5.0, 1.0):
                    rounds.setdefault(rid, []).append(t)
                while probes._pending:
                    await asyncio.sleep(0.005)
        assert all(not core.replicas[ep.replica_id].probing for ep in eps)
        firsts = sorted(times[0] for times in rounds.values())
        assert firsts == [120, 121, 122, 123], rounds  # one a round, the longest idle first
        every = sorted(t for times in rounds.values() for t in times)
        assert len(every) == len(set(every)), rounds  # never two in one round, however long idle
        assert all(len(times) == 4 and times[1] - times[0] == 120 for times in rounds.values()), rounds
