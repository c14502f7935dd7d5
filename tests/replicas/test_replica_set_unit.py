"""ReplicaSet without vLLM: wrapping existing servers (a stand-in), replica ids, sharing Ray."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request

import pytest
import pytest_asyncio

from replicas import replica_set as rs_mod
from replicas.config import ReplicaSetConfig
from replicas.ids import replica_index
from replicas.replica_set import ReplicaEndpoint, ReplicaSet, replica_id
from replicas.server import free_port
from tests.replicas.fake_server import FAKE_SERVER


@pytest_asyncio.fixture(loop_scope="session")
async def fake_url():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", FAKE_SERVER, "--port", str(port)], stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            break
        except OSError:
            time.sleep(0.05)
    yield url
    proc.kill()
    proc.wait()


async def test_urls_are_wrapped_without_launching(fake_url):
    async with ReplicaSet(ReplicaSetConfig(urls=(fake_url + "/",), served_model_name="m")) as rs:
        assert rs.endpoints == [ReplicaEndpoint(replica_id(0), fake_url, 32, 16384, "m", False)]
        assert rs.endpoint("replica-0").base_url == fake_url
        with pytest.raises(ValueError, match="urls"):
            await rs.restart("replica-0")
    assert rs.endpoints == []


async def test_a_drain_checks_idle_only_after_every_handler_saw_draining(fake_url):
    """The router stops placing work on a draining replica only once it has handled the event;
    an idle check before that (the router between two requests) stopped the replica while a
    request was being placed there (CI: a 401 relayed, the key already forgotten)."""
    import asyncio

    async with ReplicaSet(ReplicaSetConfig(urls=(fake_url,), served_model_name="m")) as rs:
        seen: list[str] = []

        async def slow_router(event):  # a handler that takes a while, as a busy loop does
            await asyncio.sleep(0.2)
            seen.append(event.kind)

        rs.subscribe(slow_router)
        at_idle: list[list[str]] = []

        async def idle() -> bool:
            at_idle.append(list(seen))
            return True

        assert await rs.remove("replica-0", drain_timeout_s=5, idle=idle) is True
        assert at_idle == [["draining"]]  # the first check came after the router knew
        await rs.events.flush()
        assert seen == ["draining", "removed"] and rs.endpoints == []


async def test_an_unreachable_url_fails_start_by_name():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(RuntimeError) as err:  # named as the YAML config writes it
        await ReplicaSet(ReplicaSetConfig(urls=(url,))).start()
    assert str(err.value) == f"replicas.urls[0] {url} does not answer GET /health"


@pytest.mark.parametrize("status, hint", [(401, "needs an API key"), (500, "")])
async def test_a_url_whose_metrics_are_refused_fails_start_in_one_line(status, hint):
    """A server started with ``--api-key`` answers /health but refuses /metrics: a one-line
    refusal naming the URL and the status, not a traceback (a fresh user's report)."""
    from aiohttp import web

    from replicas.config import StartupError
    from tests.loopback import app_on_loopback

    app = web.Application()
    app.router.add_get("/health", lambda _: web.Response(text=""))
    app.router.add_get("/metrics", lambda _: web.Response(status=status, text="no"))
    async with app_on_loopback(app) as url:
        with pytest.raises(StartupError) as err:
            await ReplicaSet(ReplicaSetConfig(urls=(url,))).start()
    message = str(err.value)
    assert message.startswith(f"replicas.urls[0] {url} answers GET /metrics with HTTP {status}")
    assert (hint in message) and ("\n" not in message)


def test_replica_ids():
    assert replica_id(3) == "replica-3" and replica_index("replica-12") == 12
    with pytest.raises(KeyError):
        replica_index("r-1")


async def test_ray_is_shared_and_shut_down_by_the_last_user(monkeypatch):
    calls: list[str] = []
    state = {"up": False}
    fake_ray = type(sys)("ray")
    fake_ray.is_initialized = lambda: state["up"]
    fake_ray.init = lambda **kw: (calls.append("init"), state.update(up=True))
    fake_ray.shutdown = lambda: (calls.append("shutdown"), state.update(up=False))
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    users = rs_mod._RayUsers()
    await users.acquire(None)
    await users.acquire(None)
    await users.release()
    assert calls == ["init"] and state["up"]
    await users.release()
    assert calls == ["init", "shutdown"] and not state["up"]
    state["up"] = True  # someone else's Ray: used, never shut down
    await users.acquire(None)
    await users.release()
    assert calls == ["init", "shutdown"]


async def test_a_failed_ray_start_is_retried_then_reported(monkeypatch):
    calls: list[str] = []
    fake_ray = type(sys)("ray")
    fake_ray.is_initialized = lambda: False
    fake_ray.shutdown = lambda: calls.append("shutdown")

    def init(**kw):
        calls.append("init")
        raise Exception("The current node timed out during startup.")

    fake_ray.init = init
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    users = rs_mod._RayUsers()
    with pytest.raises(RuntimeError, match="failed 3 times: The current node timed out"):
        await users.acquire(None)
    assert calls == ["init", "shutdown"] * 3 and users.users == 0
