"""A rolling weight update stops at its first failed load (no vLLM: a real router over real HTTP
in front of fake vLLM servers with the weight-update endpoints). A fresh attacker saw a bad
``weights_path`` pause every replica in turn, each to fail the same load."""

from __future__ import annotations

import aiohttp
import pytest

from router import keys
from tests.router.fake_vllm import FakeVllm, serving
from tests.router.test_fleet_changes import ADMIN, router

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
