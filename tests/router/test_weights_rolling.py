"""A rolling weight update stops at its first failed load (no vLLM: a real router over real HTTP
in front of fake vLLM servers with the weight-update endpoints). A fresh attacker saw a bad
``weights_path`` pause every replica in turn, each to fail the same load."""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp
import pytest

from router import keys
from tests.router.fake_vllm import FakeVllm, serving
from tests.router.test_fleet_changes import ADMIN, call, router

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def update(url: str, path: str) -> dict:
    body = {"version": 1, "weights_path": path, "policy": "salt", "mode": "rolling", "pause_mode": "keep"}
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/admin/weights", json=body, headers=ADMIN) as r:
            return await r.json()


async def test_a_rolling_update_stops_at_the_first_failed_load_and_leaves_the_rest_untouched():
    fakes = [FakeVllm(), FakeVllm(), FakeVllm()]
    async with serving(fakes[0]) as u0, serving(fakes[1]) as u1, serving(fakes[2]) as u2, \
            router([u0, u1, u2]) as (url, _, _rs):
        report = await update(url, "missing-ckpt")
        first = [f for f in fakes if f.loads]
        assert len(first) == 1 and first[0].loads == ["missing-ckpt"]  # tried once, on one replica
        assert sum(len(f.pauses) for f in fakes) == 1  # the others were never paused
        phases = sorted(r["phase"] for r in report["replicas"])
        assert not report["ok"] and phases == ["released", "skipped", "skipped"], report
        assert all(r["in_rotation"] and r["weight_version"] == 0 and r["pause_mode"] == "keep"
                   for r in report["replicas"]), report
        skipped = [r for r in report["replicas"] if r["phase"] == "skipped"]
        assert all("missing-ckpt" in r["error"] and "failed on replica-" in r["error"] for r in skipped), skipped
        # good weights then update every replica, the first included
        report = await update(url, "ckpt-1")
        assert report["ok"] and [f.weights for f in fakes] == ["ckpt-1"] * 3, report


async def test_a_version_the_fleet_has_is_not_loaded_from_another_folder_nor_its_policy_switched():
    # a fresh attacker: POST /admin/weights with the fleet's own version and another folder said
    # ok, loaded nothing (every replica was at that version already), and switched the fleet's
    # policy to the request's default. One version is one set of weights
    fakes = [FakeVllm(), FakeVllm()]
    async with serving(fakes[0]) as u0, serving(fakes[1]) as u1, router([u0, u1]) as (url, app, _rs):
        assert (await update(url, "ckpt-1"))["ok"]
        versions = app[keys.CORE].versions
        async with aiohttp.ClientSession() as http:
            async def post(body: dict) -> tuple[int, dict]:
                async with http.post(url + "/admin/weights", json=body, headers=ADMIN) as r:
                    return r.status, await r.json()

            same = {"version": 1, "weights_path": "ckpt-1", "policy": "salt", "mode": "rolling", "pause_mode": "keep"}
            status, report = await post({**same, "weights_path": "ckpt-2"})
            assert status == 409 and report["error"]["param"] == "weights_path", report
            assert "'ckpt-1'" in report["error"]["message"], report
            status, report = await post({k: v for k, v in same.items() if k != "policy"})  # the default: keep+salt
            assert status == 409 and report["error"]["param"] == "policy", report
            assert (versions.current, versions.policy) == (1, "salt")
            status, first = await post(same)  # the same call again, finished: nothing to do, and its report
            assert status == 200 and first["ok"] and len(first["replicas"]) == 2, first
            status, report = await post({**same, "weights_path": "./ckpt-1", "replicas": ["replica-0"]})
            assert status == 200 and report == first, report
        assert [f.loads for f in fakes] == [["ckpt-1"], ["ckpt-1"]]
        assert (versions.current, versions.policy) == (1, "salt")


async def _scraped(app, rid: str, timeout_s: float = 10.0) -> None:
    """Until a scrape of ``rid`` was answered (its server's process start time is known), as in a
    router that has served a while: a server killed under the router's first scrape, whose scrape
    then hangs, leaves nothing to compare the next process with."""
    deadline = time.monotonic() + timeout_s
    while not app[keys.POOL].get(rid).process_start_s:
        assert time.monotonic() < deadline, f"no scrape of {rid} answered"
        await asyncio.sleep(0.02)


class _Servers:
    """Two fake vLLM servers on loopback (:func:`two_servers`); the second can be stopped and a
    fresh one served on its port: a server restarted by something other than the router (a pod's
    restart policy), on its start-up weights."""

    def __init__(self, fakes: list[FakeVllm]) -> None:
        self.fakes, self.urls = fakes, []
        self._second: contextlib.AbstractAsyncContextManager | None = None

    async def stop_second(self) -> None:
        if self._second is not None:
            second, self._second = self._second, None
            await second.__aexit__(None, None, None)

    async def serve_second(self, fresh: FakeVllm, gap_s: float = 0.0) -> None:
        """Stop the second server, wait ``gap_s``, serve ``fresh`` on its port."""
        await self.stop_second()
        await asyncio.sleep(gap_s)
        self.fakes[1], self._second = fresh, serving(fresh, int(self.urls[1].rsplit(":", 1)[1]))
        await self._second.__aenter__()


@contextlib.asynccontextmanager
async def two_servers(weights: str = "0"):
    """:class:`_Servers` over two fresh fakes serving ``weights``."""
    servers = _Servers([FakeVllm(), FakeVllm()])
    for fake in servers.fakes:
        fake.weights = weights
    async with serving(servers.fakes[0]) as u0:
        servers._second = serving(servers.fakes[1])
        servers.urls = [u0, await servers._second.__aenter__()]
        try:
            yield servers
        finally:
            await servers.stop_second()


@pytest.mark.parametrize("gap_s, scrape_s", [(1.0, 0.1), (0.0, 1.5)],
                         ids=["refused-while-down", "back-before-a-scrape-missed-it"])
async def test_a_server_given_by_url_restarted_by_someone_else_is_caught_up_before_its_answers_name_a_version(
        gap_s, scrape_s):
    # a new user: a URL server that came back after a restart served its start-up weights while
    # the router went on naming the fleet's version for its answers (it never knew it restarted).
    # Seen as a restart either way: its scrapes refused (nothing listened on its port) or, back
    # before a scrape missed it, another process start time
    async with two_servers() as servers, router(servers.urls, scrape_interval_s=scrape_s) as (url, app, _rs):
        assert (await update(url, "ckpt-1"))["ok"]
        async with aiohttp.ClientSession() as http:
            for i in range(4):  # traffic on both
                async with http.post(url + "/v1/completions", json={"prompt": [7 + i] * 40, "max_tokens": 1},
                                     headers={"X-Session-Id": f"s{i}"}) as r:
                    assert r.status == 200
            assert servers.fakes[1].prompt_tokens > 0
            await _scraped(app, "replica-1")
            fresh = FakeVllm()
            await servers.serve_second(fresh, gap_s)
            if not gap_s:  # back at once: only its process start time tells, at the next scrape (no
                await asyncio.sleep(2 * scrape_s)  # request can tell before: they are answered as before)
            deadline = time.monotonic() + 20
            answers = []
            while not fresh.loads or time.monotonic() < deadline - 15:  # and a while after it
                assert time.monotonic() < deadline, "the restarted server was never caught up"
                prompt = [3 + len(answers) % 900] * 40  # new prompts: placed by load, on both
                async with http.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}) as r:
                    assert r.status == 200
                    answers.append((r.headers["X-Rollout-Replica"], (await r.json())["rollout_router"],
                                    fresh.weights))
                await asyncio.sleep(0.05)
            core = app[keys.CORE]
            assert fresh.loads == ["ckpt-1"] and core.versions.loaded["replica-1"] == 1
            # no answer from the restarted server named version 1 before it had version 1's weights
            wrong = [a for a in answers if a[0] == "replica-1" and a[1]["weight_version"] == 1 and a[2] != "ckpt-1"]
            assert not wrong, wrong
            assert any(a[0] == "replica-1" and a[2] == "ckpt-1" for a in answers), answers  # it serves again
            _, weights, _ = await call("GET", url + "/admin/weights", headers=ADMIN)
            shown = weights["replicas"]["replica-1"]
            assert (shown["phase"], shown["weight_version"], shown["in_rotation"]) == ("serving", 1, True), shown


async def test_a_server_gone_down_is_shown_unhealthy_not_serving_by_get_admin_weights():
    # a new user: a killed server read `serving`, in rotation, in GET /admin/weights (no health
    # field there), while the router had stopped routing to it
    async with two_servers() as servers, router(servers.urls, scrape_interval_s=0.1) as (url, app, _rs):
        _, weights, _ = await call("GET", url + "/admin/weights", headers=ADMIN)
        assert [(r["phase"], r["healthy"]) for r in weights["replicas"].values()] == [("serving", True)] * 2
        await servers.stop_second()
        deadline = time.monotonic() + 10
        while app[keys.CORE].replicas["replica-1"].healthy:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        _, weights, _ = await call("GET", url + "/admin/weights", headers=ADMIN)
        shown = weights["replicas"]["replica-1"]
        assert (shown["phase"], shown["healthy"], shown["in_rotation"]) == ("unhealthy", False, True), shown
        _, replicas, _ = await call("GET", url + "/admin/replicas", headers=ADMIN)
        row = next(r for r in replicas["replicas"] if r["replica"] == "replica-1")
        assert (row["healthy"], row["in_rotation"]) == (False, True), row


async def _until_caught_up(app, fresh: FakeVllm, timeout_s: float = 20.0) -> None:
    """Until ``fresh`` (replica-1's server) took a load and replica-1 is healthy and in rotation."""
    core, deadline = app[keys.CORE], time.monotonic() + timeout_s
    while not (fresh.loads and core.replicas["replica-1"].healthy and "replica-1" not in core.versions.rotation):
        assert time.monotonic() < deadline, (fresh.loads, core.versions.rotation)
        await asyncio.sleep(0.05)


async def test_a_server_an_update_failed_on_while_it_was_down_is_caught_up_once_it_is_back():
    # a new user: a URL server down during an update was reported failed and stayed out for good
    # once back (only the same update posted again brought it back)
    async with two_servers() as servers, router(servers.urls, scrape_interval_s=0.1) as (url, app, _rs):
        await servers.stop_second()
        report = await update(url, "ckpt-1")
        phases = {r["replica"]: r["phase"] for r in report["replicas"]}
        assert not report["ok"] and phases == {"replica-0": "done", "replica-1": "failed"}, report
        fresh = FakeVllm()
        await servers.serve_second(fresh)
        await _until_caught_up(app, fresh)
        _, weights, _ = await call("GET", url + "/admin/weights", headers=ADMIN)
        shown = weights["replicas"]["replica-1"]
        assert fresh.loads == ["ckpt-1"] and fresh.weights == "ckpt-1", fresh.loads
        assert (shown["phase"], shown["weight_version"]) == ("serving", 1), shown


async def test_a_restarted_url_server_is_reloaded_even_at_the_routers_initial_version():
    # a fresh attacker: a router started with --initial-weight-version 1 (its servers had taken
    # version 1 from an earlier router) took a server restarted on its seed-0 start-up model for
    # version 1, the initial one, and named 1 for its answers
    async with two_servers(weights="ckpt-1") as servers, router(
            servers.urls, scrape_interval_s=0.1, initial_weight_version=1, initial_weights_path="ckpt-1") as (url, app, _rs):
        await _scraped(app, "replica-1")
        fresh = FakeVllm()
        await servers.serve_second(fresh, 0.5)
        await _until_caught_up(app, fresh)
        assert fresh.loads == ["ckpt-1"] and app[keys.CORE].versions.loaded["replica-1"] == 1


async def test_a_supervisors_healthy_event_does_not_put_a_new_process_back_before_the_scrape_takes_it():
    # a fresh attacker: the replica set's /health poll said `healthy` 118 ms before the scrape
    # found the server was a new process, and for that time it was routed to under the old version
    from replicas.events import ReplicaEvent
    from router.fleet import on_replica_event

    async with two_servers() as servers, router(servers.urls, scrape_interval_s=0.5) as (url, app, rs):
        assert (await update(url, "ckpt-1"))["ok"]
        core, pool = app[keys.CORE], app[keys.POOL]
        await _scraped(app, "replica-1")
        await servers.stop_second()
        deadline = time.monotonic() + 10
        while not pool.get("replica-1").gone:  # a refused scrape
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        fresh = FakeVllm()
        await servers.serve_second(fresh)
        on_replica_event(app, ReplicaEvent("healthy", "replica-1", rs.endpoints[1]))
        assert not core.replicas["replica-1"].healthy  # until the scrape takes the restart
        await _until_caught_up(app, fresh)
        assert fresh.loads == ["ckpt-1"]
