"""Two-phase updates, cancellation, failed loads and staleness, on a real vLLM-CPU replica.

The trainer's out-of-band push is played by the test itself: between ``begin`` and ``commit`` it
loads the seed-1 folder into the engine (``collective_rpc reload_weights``), since NCCL/IPC
transfer needs GPUs. What each answer claims is checked against the checkpoints
(``tests.router.weights_check``).
"""

from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest

from replicas.tiny_model import TinyModelSpec, ensure_tiny_model
from replicas.weights import ReplicaControl
from replicas.weights_http import call
from router import keys
from router.config import AppConfig
from router.server import running_router
from tests.engine_brake import EngineBrake
from tests.router.small_replica import weight_test_fixtures
from tests.router.weights_check import Claim, verify

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]

TOKEN = "test-admin-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
CKPT = {0: str(ensure_tiny_model(spec=TinyModelSpec(seed=0))), 1: str(ensure_tiny_model(spec=TinyModelSpec(seed=1)))}


small, http = weight_test_fixtures("module", CKPT[0])


def config(**router) -> AppConfig:
    return AppConfig().replace(router={"port": 0, "scrape_interval_s": 0.2, "admin_token": TOKEN,
                                       "initial_weights_path": CKPT[0], **router})


async def admin(http, url: str, path: str, body: dict) -> tuple[int, dict]:
    async with http.post(url + "/admin/weights" + path, json=body, headers=ADMIN) as r:
        return r.status, await r.json()


async def state(http, url: str) -> dict:
    async with http.get(url + "/admin/weights", headers=ADMIN) as r:
        return await r.json()


async def score(http, url: str, seed: int) -> tuple[dict, list[Claim]]:
    rng = random.Random(seed)
    context = [rng.randrange(8, 1000) for _ in range(90)]
    responses = [[rng.randrange(8, 1000) for _ in range(12)] for _ in range(2)]
    async with http.post(url + "/v1/score", json={"context": context, "responses": responses}) as r:
        answer = await r.json()
        assert r.status == 200, answer
    return answer, [Claim(answer["weight_version"], context + row["token_ids"], len(context), row["logprobs"],
                          f"score {seed}/{row['index']}") for row in answer["results"]]


async def test_begin_push_commit_with_idempotent_calls_and_phases(http, small):
    base = small.endpoints[0].base_url
    claims: list[Claim] = []
    async with running_router(config(weight_update_policy="salt"), small.endpoints) as (url, app):
        claims += (await score(http, url, 1))[1]
        status, begun = await admin(http, url, "/begin", {"version": 1, "pause_mode": "keep"})
        assert status == 200 and begun["phase"] == "ready" and begun["replicas"][0]["phase"] == "paused", begun
        assert (await admin(http, url, "/begin", {"version": 1}))[1]["phase"] == "ready"  # the same call again
        status, other = await admin(http, url, "/begin", {"version": 2})
        assert status == 409 and "weight update 1" in other["error"]["message"]
        assert (await state(http, url))["replicas"]["replica-0"]["phase"] == "paused"
        assert (await call(http, "GET", f"{base}/is_paused")).body == {"is_paused": True}
        waiting = asyncio.ensure_future(score(http, url, 2))  # held by the router until the commit
        await asyncio.sleep(0.3)
        # held by the router (its placement waits for the rotation), not sent to the paused engine,
        # where it would also wait: nothing of it in flight there by the router's own count
        assert not waiting.done() and app[keys.CORE].in_flight("replica-0") == 0
        assert app[keys.LIFECYCLE].state_sizes()["flights"] == 0

        weights, error = await ReplicaControl(http, base).load(CKPT[1], CKPT[0])  # the trainer's push
        assert weights == "new", error
        status, done = await admin(http, url, "/commit", {"version": 1, "weights_path": CKPT[1]})
        assert status == 200 and done["phase"] == "done" and done["replicas"][0]["weight_version"] == 1, done
        assert (await admin(http, url, "/commit", {"version": 1}))[1] == {**done, "state": done["state"]}
        assert (await admin(http, url, "/abort", {"version": 1}))[1]["phase"] == "done"  # too late: reported
        answer, more = await asyncio.wait_for(waiting, 60)
        assert answer["weight_version"] == 1 and answer["cache_salt"] == "rr:v1"
        claims += more
        after = await state(http, url)
        assert after["current_version"] == 1 and after["replicas"]["replica-0"]["phase"] == "serving"
    verdict = await verify(http, base, claims, CKPT)
    assert verdict.checked == 4 and not verdict.mismatched and not verdict.unmatched, verdict


async def test_abort_resumes_on_the_previous_weights_and_a_silent_trainer_is_aborted(http, small):
    base = small.endpoints[0].base_url
    async with running_router(config(weight_update_policy="keep+salt"), small.endpoints) as (url, _):
        assert (await admin(http, url, "/begin", {"version": 3}))[0] == 200
        await ReplicaControl(http, base).load(CKPT[1], CKPT[0])  # a push that goes wrong halfway
        status, aborted = await admin(http, url, "/abort", {"version": 3, "restore": True})
        assert status == 200 and aborted["phase"] == "aborted", aborted
        assert aborted["replicas"][0]["weight_version"] == 0 and aborted["replicas"][0]["in_rotation"]
        _, claims = await score(http, url, 3)
        assert {c.version for c in claims} == {0}

        status, begun = await admin(http, url, "/begin", {"version": 4, "commit_timeout_s": 0.5})
        assert status == 200, begun
        for _ in range(100):  # nobody commits: the router aborts it itself
            if (await state(http, url))["update"] is None:
                break
            await asyncio.sleep(0.1)
        last = (await state(http, url))["last_update"]
        assert (last["version"], last["phase"]) == (4, "aborted") and last["replicas"][0]["in_rotation"], last
        assert (await call(http, "GET", f"{base}/is_paused")).body == {"is_paused": False}
        claims += (await score(http, url, 4))[1]
    verdict = await verify(http, base, claims, CKPT)
    assert not verdict.mismatched and not verdict.unmatched, verdict


async def test_a_trainer_that_disconnects_mid_update_leaves_every_replica_serving(http, small):
    base = small.endpoints[0].base_url
    pgid = (await small.info(small.endpoints[0].replica_id)).pid
    async with running_router(config(weight_update_policy="flush"), small.endpoints) as (url, app), \
            EngineBrake(pgid) as brake:
        body = {"prompt": list(range(100, 180)), "max_tokens": 400, "ignore_eos": True}
        long = asyncio.ensure_future(http.post(url + "/v1/completions", json=body))
        core = app[keys.CORE]
        # held while it runs: the update's drain (pause_mode wait) cannot end before the trainer gives up
        await brake.hold_when(lambda: core.in_flight("replica-0") > 0, 60, what="the long request dispatched")
        update = {"version": 5, "weights_path": CKPT[1], "pause_mode": "wait"}
        async with aiohttp.ClientSession() as trainer:  # times out while the update drains the long request
            with pytest.raises(asyncio.TimeoutError):
                await trainer.post(url + "/admin/weights", json=update, headers=ADMIN,
                                   timeout=aiohttp.ClientTimeout(total=0.3))
        assert (await state(http, url))["replicas"]["replica-0"]["phase"] == "draining"
        brake.release()
        (await long).release()
        status, again = await admin(http, url, "", update)  # the trainer retries: joins or reads the result
        assert status == 200 and again["replicas"][0]["weight_version"] == 5, again
        after = await state(http, url)
        assert after["replicas"]["replica-0"]["in_rotation"] and after["update"] is None
    assert (await call(http, "GET", f"{base}/is_paused")).body == {"is_paused": False}


async def test_a_failed_load_restores_the_old_weights_and_the_replica_serves_them(http, small):
    base = small.endpoints[0].base_url
    async with running_router(config(weight_update_policy="salt"), small.endpoints) as (url, _):
        status, report = await admin(http, url, "", {"version": 6, "weights_path": "/nonexistent/ckpt"})
        replica = report["replicas"][0]
        assert status == 502 and replica["weights"] == "previous" and replica["in_rotation"], report
        assert replica["weight_version"] == 0 and "restored" in replica["error"]
        answer, claims = await score(http, url, 6)
        assert answer["weight_version"] == 0 and answer["cache_salt"] == "rr:v0"
        async with http.get(url + "/health") as r:
            assert r.status == 200
    verdict = await verify(http, base, claims, CKPT)
    assert verdict.checked == 2 and not verdict.mismatched and not verdict.unmatched, verdict


async def test_a_request_too_far_behind_gets_409_naming_both_versions(http, small):
    async with running_router(config(weight_update_policy="salt", max_staleness=1,
                                     initial_weight_version=4), small.endpoints) as (url, _):
        body = {"prompt": [5, 6, 7, 8], "max_tokens": 1}
        async with http.post(url + "/v1/completions", json=body, headers={"X-Weight-Version": "2"}) as r:
            error = (await r.json())["error"]
        assert r.status == 409 and error["param"] == "weight_version"
        assert "weight_version 2" in error["message"] and "current version 4" in error["message"]
        async with http.post(url + "/v1/completions", json=body, headers={"X-Weight-Version": "3"}) as r:
            assert r.status == 200
