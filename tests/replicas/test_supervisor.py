"""The supervisor loop against real HTTP peers that misbehave (no vLLM): garbage never stops it."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import pytest
from aiohttp import web

from replicas.events import EventBus
from replicas.replica_set import ReplicaEndpoint, replica_id
from replicas.supervisor import RestartBudget, SupervisionConfig, Supervisor

FAST = SupervisionConfig(interval_s=0.05, health_timeout_s=0.3, restart_after_failures=2, max_restarts=2,
                         restart_window_s=60, backoff_initial_s=0.01, backoff_max_s=0.04)


async def _html(request):
    return web.Response(status=200, text="<html><body>not vLLM</body></html>", content_type="text/html")


async def _bad_utf8(request):
    return web.Response(status=500, body=b"\xff\xfe\xfa not utf-8 \xc3\x28", content_type="text/plain")


async def _hang(request):
    await asyncio.sleep(3600)


async def _reset(request):
    request.transport.close()  # the peer drops the connection without answering
    await asyncio.sleep(3600)


async def _ok(request):
    return web.Response(text="")


class _Peers:
    """Real aiohttp servers on loopback, one per behaviour."""

    def __init__(self) -> None:
        self.runners: list[web.AppRunner] = []

    async def serve(self, handler) -> str:
        app = web.Application()
        app.router.add_get("/health", handler)
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.runners.append(runner)
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def close(self) -> None:
        for runner in self.runners:
            await runner.cleanup()


class _Owner:
    """The supervisor's view of a replica set, over real URLs; restarts hand out ``next_urls``."""

    def __init__(self, session, urls: dict[int, str], managed: set[int], dead: set[int] = frozenset()) -> None:
        self.health_session = session
        self.endpoints = {i: _endpoint(i, u) for i, u in urls.items()}
        self.managed_set, self.dead = set(managed), set(dead)
        self.next_urls: list[str] = []
        self.restarts: list[int] = []
        self.given_up: list[tuple[int, str]] = []

    def watched(self):
        return dict(self.endpoints)

    def managed(self, index):
        return index in self.managed_set

    async def process_alive(self, index):
        if index in self.dead:
            raise RuntimeError("actor died")  # what Ray raises for a dead actor, in kind
        return True

    async def restart(self, rid):
        index = int(str(rid).rsplit("-", 1)[1])
        self.restarts.append(index)
        self.endpoints.pop(index, None)
        if not self.next_urls:
            raise RuntimeError("no server came up")
        self.dead.discard(index)
        self.endpoints[index] = _endpoint(index, self.next_urls.pop(0))
        return self.endpoints[index]

    async def give_up(self, index, reason):
        self.endpoints.pop(index, None)
        self.given_up.append((index, reason))


def _endpoint(index: int, url: str) -> ReplicaEndpoint:
    return ReplicaEndpoint(replica_id(index), url, 32, 100, "m")


@pytest.fixture
async def peers():
    p = _Peers()
    yield p
    await p.close()


async def _run(owner, rounds: int) -> list:
    events = EventBus()
    seen: list = []
    events.subscribe(seen.append)
    sup = Supervisor(owner, FAST, events)
    for _ in range(rounds):
        await sup.check_all()
        await asyncio.sleep(FAST.interval_s)
    for _ in range(100):  # let restarts in progress finish
        if all(w.restarting is None for w in sup._watches.values()):
            break
        await asyncio.sleep(0.05)
    await sup.stop()
    await events.close()
    return [(e.kind, e.replica_id) for e in seen], seen


async def test_garbage_health_answers_are_failed_checks_and_the_loop_goes_on(peers):
    html, bad, hang, reset, ok = [await peers.serve(h) for h in (_html, _bad_utf8, _hang, _reset, _ok)]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        refused = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens there
    urls = {0: html, 1: bad, 2: hang, 3: reset, 4: refused, 5: ok}
    async with aiohttp.ClientSession() as session:
        kinds, seen = await _run(_Owner(session, urls, managed=set()), rounds=3)
    # an HTML 200 is a healthy /health (vLLM's is empty); every other peer failed, once announced
    assert sorted(kinds) == sorted(("unhealthy", replica_id(i)) for i in (1, 2, 3, 4))
    reasons = {e.replica_id: e.reason for e in seen}
    assert "answered 500" in reasons[replica_id(1)]
    assert "within 0.3 s" in reasons[replica_id(2)]
    assert "failed" in reasons[replica_id(3)] and "failed" in reasons[replica_id(4)]


async def test_a_wedged_managed_replica_is_restarted_at_a_new_url_and_announced(peers):
    hang, ok = await peers.serve(_hang), await peers.serve(_ok)
    async with aiohttp.ClientSession() as session:
        owner = _Owner(session, {0: hang}, managed={0})
        owner.next_urls = [ok]
        kinds, seen = await _run(owner, rounds=4)
    assert owner.restarts == [0]
    assert kinds[:3] == [("unhealthy", "replica-0"), ("restarting", "replica-0"), ("restarted", "replica-0")]
    assert seen[2].endpoint.base_url == ok and "2 failed health checks" in seen[1].reason


async def test_a_dead_actor_is_restarted_at_once_and_the_budget_gives_it_up(peers):
    ok = await peers.serve(_ok)
    async with aiohttp.ClientSession() as session:
        owner = _Owner(session, {0: ok, 1: ok}, managed={0, 1}, dead={0})
        kinds, seen = await _run(owner, rounds=2)  # no next_urls: every restart of replica 0 fails
    assert owner.restarts == [0, 0]  # max_restarts=2 attempts, then given up
    assert kinds == [("restarting", "replica-0"), ("removed", "replica-0")]
    assert owner.given_up[0][0] == 0 and "restart budget spent: 2 restarts" in owner.given_up[0][1]
    assert replica_id(1) in [e.replica_id for e in owner.watched().values()]  # the healthy one untouched


async def test_a_recovered_replica_is_announced_healthy_once(peers):
    flaky = {"fail": True}

    async def handler(request):
        return web.Response(status=503 if flaky["fail"] else 200)

    url = await peers.serve(handler)
    events, seen = EventBus(), []
    events.subscribe(seen.append)
    async with aiohttp.ClientSession() as session:
        sup = Supervisor(_Owner(session, {0: url}, managed=set()), FAST, events)
        await sup.check_all()
        await sup.check_all()
        flaky["fail"] = False
        await sup.check_all()
        await sup.check_all()
        await events.close()
    assert [e.kind for e in seen] == ["unhealthy", "healthy"]


def test_restart_budget_backs_off_and_forgets_old_restarts():
    budget = RestartBudget(SupervisionConfig(max_restarts=3, restart_window_s=100, backoff_initial_s=2,
                                             backoff_max_s=5))
    assert budget.delay(0) == 2
    budget.record(0)
    budget.record(10)
    assert (budget.delay(10), budget.exhausted(10)) == (5, False)  # 2*2**2 = 8, capped at 5
    budget.record(20)
    assert budget.exhausted(20) and budget.recent(100.5) == 2 and not budget.exhausted(100.5)


async def test_a_failing_event_handler_does_not_stop_delivery():
    events, got = EventBus(), []

    def broken(event):
        raise ValueError("subscriber bug")

    async def good(event):
        got.append(event.seq)

    events.subscribe(broken)
    events.subscribe(good)
    for _ in range(3):
        events.publish("unhealthy", replica_id(0), None, "x")
    await events.close()
    assert got == [1, 2, 3]


async def test_a_replica_its_router_found_hung_is_restarted_once_within_the_budget(peers):
    # an engine hung behind a live API server answers /health: only the router's stall rule sees
    # it (DecisionCore.restart_due), and it asks the supervisor (ReplicaSet.engine_stalled)
    ok, fresh = await peers.serve(_ok), await peers.serve(_ok)
    events, seen = EventBus(), []
    events.subscribe(seen.append)
    async with aiohttp.ClientSession() as session:
        owner = _Owner(session, {0: ok, 1: ok}, managed={0})
        owner.next_urls = [fresh]
        sup = Supervisor(owner, FAST, events)
        assert sup.wedged(0, "its engine stalled 3 times in a row")
        assert not sup.wedged(0, "again, while the restart runs")  # one restart at a time
        assert not sup.wedged(1, "not launched by this set")  # replicas.urls: never restarted
        off = Supervisor(owner, SupervisionConfig(enabled=False), events)
        assert not off.wedged(0, "supervision off")
        for _ in range(100):
            if all(w.restarting is None for w in sup._watches.values()):
                break
            await asyncio.sleep(0.02)
        await sup.stop()
        await events.close()
    assert owner.restarts == [0]
    assert [(e.kind, e.replica_id) for e in seen] == [("restarting", "replica-0"), ("restarted", "replica-0")]
    assert "stalled 3 times" in seen[0].reason and seen[1].endpoint.base_url == fresh
