"""A replica launched or restarted from the model serves the initial version, whatever it had
loaded: the router labels it so and brings it to the fleet's version before it takes work
(``WeightUpdater.rejoined`` / ``catch_up``). A fresh attacker saw a replica restarted after an
update serve the seed checkpoint while every answer named the update's version.

Real routers over real HTTP in front of fake vLLM servers (``tests.router.fake_vllm``: each
token names the weights that made it). The restart is the replica set's event as the router
receives it (``router.fleet._own_event``) with the fake's weights set back to its model; a
real one is in ``tests/router/test_fault_vllm.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import json

import aiohttp
import pytest

from replicas.events import ReplicaEvent
from router import fleet, keys
from tests.router.fake_vllm import FakeVllm, serving
from tests.router.test_fleet_changes import ADMIN, router, until

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPT = list(range(10, 74))


class _Launched:
    """The router's replica set as ``_own_event`` asks it: every replica launched by it."""

    @staticmethod
    def launched(_rid) -> bool:
        return True


async def post(url: str, path: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        async with http.post(url + path, json=body, headers=ADMIN) as r:
            return r.status, await r.json()


async def tokens_from(url: str, replica: str) -> tuple[list[str], int]:
    """A stream pinned (by session) to ``replica``'s: its token texts and claimed version."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        for i in range(200):  # a session key the router pins to ``replica``
            body = {"prompt": PROMPT, "max_tokens": 2, "stream": True}
            async with http.post(url + "/v1/completions", json=body, headers={"X-Session-Id": f"s{i}"}) as r:
                raw = (await r.read()).decode()
                if r.headers["X-Rollout-Replica"] == replica:
                    break
    events = [json.loads(e[6:]) for e in raw.split("\n\n") if e.startswith("data: {")]
    return [c["text"] for e in events for c in e["choices"] if c.get("text")], events[-1]["rollout_router"]["weight_version"]


def restart(app, fake: FakeVllm, rid: str) -> None:
    """Replica ``rid`` restarted from the model, as the router hears of it."""
    fake.weights = "0"
    endpoint = next(s.endpoint for s in app[keys.POOL].states() if s.endpoint.replica_id == rid)
    fleet._own_event(app, _Launched(), ReplicaEvent("restarted", rid, endpoint))


async def test_a_replica_restarted_after_an_update_is_labelled_initial_and_catches_up_before_work():
    fakes = [FakeVllm(), FakeVllm()]
    async with serving(fakes[0]) as u0, serving(fakes[1]) as u1, router([u0, u1]) as (url, app, _rs):
        core = app[keys.CORE]
        status, report = await post(url, "/admin/weights", {"version": 1, "weights_path": "ckpt-1", "policy": "salt"})
        assert status == 200 and [f.weights for f in fakes] == ["ckpt-1", "ckpt-1"], report
        fakes[0].delay_s = 0.0
        restart(app, fakes[0], "replica-0")
        # at once: it serves the model (version 0), so it takes no work until it caught up
        assert core.versions.loaded["replica-0"] == 0
        assert core.versions.rotation["replica-0"].startswith("catching up")
        await until(lambda: _true(core.versions.loaded["replica-0"] == 1 and "replica-0" not in core.versions.rotation),
                    what="replica-0 caught up to version 1")
        assert fakes[0].loads[-1] == "ckpt-1" and fakes[0].pauses[-1] == "wait"
        texts, claimed = await tokens_from(url, "replica-0")
        assert texts == [" wckpt-1"] * 2 and claimed == 1  # what it claims is what made its tokens


async def test_a_restart_after_a_pushed_update_stays_out_until_the_next_update_takes_it_along():
    fakes = [FakeVllm(), FakeVllm()]
    async with serving(fakes[0]) as u0, serving(fakes[1]) as u1, router([u0, u1]) as (url, app, _rs):
        core = app[keys.CORE]
        status, report = await post(url, "/admin/weights/begin", {"version": 1, "policy": "salt"})
        assert status == 200, report
        for f in fakes:
            f.weights = "pushed-1"  # the trainer's own transfer
        status, report = await post(url, "/admin/weights/commit", {"version": 1})  # no folder named
        assert status == 200, report
        restart(app, fakes[0], "replica-0")
        await until(lambda: _true("pushed without a folder" in (core.versions.rotation.get("replica-0") or "")),
                    what="replica-0 left out, saying why")
        assert core.versions.loaded["replica-0"] == 0 and not fakes[0].loads
        texts, claimed = await tokens_from(url, "replica-1")  # the fleet serves on
        assert texts == [" wpushed-1"] * 2 and claimed == 1
        status, report = await post(url, "/admin/weights", {"version": 2, "weights_path": "ckpt-2", "policy": "salt"})
        assert status == 200 and {r["replica"] for r in report["replicas"]} == {"replica-0", "replica-1"}, report
        assert core.versions.loaded == {"replica-0": 2, "replica-1": 2} and not core.versions.rotation
        texts, claimed = await tokens_from(url, "replica-0")
        assert texts == [" wckpt-2"] * 2 and claimed == 2


async def _true(value: bool) -> bool:
    return value


async def test_an_update_passes_a_stalled_engine_by_and_brings_it_along_once_it_moves_again():
    # a fresh attacker: an update held a replica whose engine the router knew was stalled and
    # waited on its /pause (600 s), while the hold turned the stall rule, the probes and the
    # restart off; now it is passed by at once, left to the stall rule, and caught up once it moves
    fakes = [FakeVllm(), FakeVllm()]
    async with serving(fakes[0]) as u0, serving(fakes[1]) as u1, router([u0, u1], scrape_interval_s=0.1) as (url, app, _rs):
        core = app[keys.CORE]
        core.cfg = dataclasses.replace(core.cfg, stall_timeout_s=0.5, stall_probe_after_s=0.3, stall_restart_after=0)
        fakes[0].stall()  # hung while idle: the probe finds it
        await until(lambda: _true(core.stalled("replica-0", time.monotonic())), 15, "replica-0 stalled on its probe")
        t0 = time.monotonic()
        status, report = await post(url, "/admin/weights", {"version": 1, "weights_path": "ckpt-1", "policy": "salt"})
        took = time.monotonic() - t0
        rows = {r["replica"]: r for r in report["replicas"]}
        assert took < 5, took
        assert rows["replica-0"]["phase"] == "failed" and "stalled" in rows["replica-0"]["error"], report
        assert rows["replica-1"]["phase"] == "done" and fakes[1].weights == "ckpt-1", report
        assert fakes[0].pauses == [] and core.versions.loaded["replica-0"] == 0  # never touched
        assert core.stalled("replica-0", time.monotonic()) and "replica-0" not in core.versions.rotation
        fakes[0].resume()  # the probe is answered: back, and brought to version 1 before it takes work
        await until(lambda: _true(core.versions.loaded["replica-0"] == 1 and "replica-0" not in core.versions.rotation),
                    15, "replica-0 caught up to version 1")
        assert fakes[0].loads[-1] == "ckpt-1"
        texts, claimed = await tokens_from(url, "replica-0")
        assert texts == [" wckpt-1"] * 2 and claimed == 1


@pytest.mark.parametrize("form", ["folder", "two-phase"])
async def test_an_engine_that_hangs_at_the_update_fails_its_pause_fast_and_is_restarted(monkeypatch, form):
    # hung just before the update (not yet found stalled): its pause got no answer for 600 s,
    # then 3 resumes of 30 s each, then it stayed out failed, where no stall rule or probe looks
    # (a fresh attacker); now the pause is bounded, no resume waits on the hang, and a replica
    # this router launched is restarted (then caught up, as the test above shows)
    from router.weights import steps
    monkeypatch.setattr(steps, "SETTLED_PAUSE_TIMEOUT_S", 0.5)
    fakes = [FakeVllm(), FakeVllm()]
    async with serving(fakes[0]) as u0, serving(fakes[1]) as u1, router([u0, u1]) as (url, app, _rs):
        asked = []
        app[keys.WEIGHT_UPDATER].restart_engine = lambda rid, why: asked.append((rid, why)) or True
        fakes[0].stall(control=True)
        t0 = time.monotonic()
        if form == "folder":
            status, report = await post(url, "/admin/weights", {"version": 1, "weights_path": "ckpt-1", "policy": "salt"})
        else:
            status, report = await post(url, "/admin/weights/begin", {"version": 1, "policy": "salt"})
        took = time.monotonic() - t0
        rows = {r["replica"]: r for r in report["replicas"]}
        assert took < 5, took
        assert rows["replica-0"]["phase"] == "failed" and rows["replica-0"]["engine_hung"], report
        assert "no answer" in rows["replica-0"]["error"] and "not resumed" in rows["replica-0"]["error"], report
        if form == "folder":
            assert rows["replica-1"]["phase"] == "done" and fakes[1].weights == "ckpt-1", report
        else:
            assert rows["replica-1"]["phase"] == "paused", report  # ready for the trainer's weights
            _, aborted = await post(url, "/admin/weights/abort", {"version": 1})  # 502: replica-0 failed
            assert {r["replica"]: r["phase"] for r in aborted["replicas"]}["replica-1"] == "released", aborted
        assert [rid for rid, _ in asked] == ["replica-0"] and "did not answer" in asked[0][1]
        fakes[0].resume()


async def test_a_server_whose_engine_hung_at_the_update_is_resumed_and_caught_up_once_it_answers(monkeypatch):
    # a server given by URL cannot be restarted: its pause got no answer, and it stayed out,
    # failed and paused (its engine took the queued pause when it woke) until the next update.
    # Now each scrape round asks it to resume; once it answers, it is brought to the fleet's
    # version and serves again
    from router.weights import steps
    monkeypatch.setattr(steps, "SETTLED_PAUSE_TIMEOUT_S", 0.5)
    fakes = [FakeVllm(), FakeVllm()]
    async with serving(fakes[0]) as u0, serving(fakes[1]) as u1, router([u0, u1], scrape_interval_s=0.1) as (url, app, _rs):
        core = app[keys.CORE]
        fakes[0].stall(control=True)
        status, report = await post(url, "/admin/weights", {"version": 1, "weights_path": "ckpt-1", "policy": "salt"})
        rows = {r["replica"]: r for r in report["replicas"]}
        assert rows["replica-0"]["phase"] == "failed" and rows["replica-0"]["engine_hung"], report
        assert rows["replica-1"]["phase"] == "done" and core.versions.current == 1, report
        await asyncio.sleep(1.0)  # rounds ask it to resume; none is answered while it hangs
        assert core.versions.rotation["replica-0"].startswith("failed") and fakes[0].loads == []
        fakes[0].resume()  # it wakes: takes the queued pause, then the resume, then version 1
        await until(lambda: _true(core.versions.loaded["replica-0"] == 1 and "replica-0" not in core.versions.rotation),
                    15, "replica-0 resumed and caught up to version 1")
        assert fakes[0].pauses[0] == "wait" and fakes[0].loads == ["ckpt-1"] and fakes[0]._unpaused.is_set()
        texts, claimed = await tokens_from(url, "replica-0")
        assert texts == [" wckpt-1"] * 2 and claimed == 1
        assert "resumed (and brought to the fleet's version) once its engine answers again" in rows["replica-0"]["error"]


async def test_a_router_started_beside_a_paused_engine_keeps_it_out_until_an_update_takes_it_along():
    # a fresh attacker: a router (local state) started while an update run by another, since
    # stopped, had left a replica paused with undefined weights, put it in rotation at version 0;
    # requests sent there hung until the stall rule or request_timeout_s
    fakes = [FakeVllm(), FakeVllm()]
    fakes[0]._unpaused.clear()  # paused, as a failed update elsewhere left it
    async with serving(fakes[0]) as u0, serving(fakes[1]) as u1, router([u0, u1], scrape_interval_s=0.1) as (url, app, _rs):
        core = app[keys.CORE]
        reason = core.versions.rotation.get("replica-0") or ""
        assert reason.startswith("failed: its engine was paused when this router took it"), core.versions.rotation
        assert core.versions.loaded["replica-0"] is None and "replica-1" not in core.versions.rotation
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            for i in range(6):  # every session lands on the replica that serves
                body = {"prompt": PROMPT, "max_tokens": 1}
                async with http.post(url + "/v1/completions", json=body, headers={"X-Session-Id": f"p{i}"}) as r:
                    assert r.status == 200 and r.headers["X-Rollout-Replica"] == "replica-1"
        status, report = await post(url, "/admin/weights", {"version": 1, "weights_path": "ckpt-1", "policy": "salt"})
        assert status == 200 and {r["replica"]: r["phase"] for r in report["replicas"]} == \
            {"replica-0": "done", "replica-1": "done"}, report
        assert core.versions.loaded == {"replica-0": 1, "replica-1": 1} and not core.versions.rotation
        texts, claimed = await tokens_from(url, "replica-0")
        assert texts == [" wckpt-1"] * 2 and claimed == 1
        third = FakeVllm()
        third._unpaused.clear()  # a paused server registered later is held out the same way
        async with serving(third) as u2:
            status, body = await post(url, "/admin/replicas", {"url": u2})
            assert status == 201 and body["out_of_rotation_reason"].startswith("failed: its engine was paused"), body
            assert core.versions.loaded[body["replica"]] is None and body["replica"] in core.versions.rotation

