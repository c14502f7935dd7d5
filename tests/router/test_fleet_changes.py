"""Fleet changes at the edges (no vLLM): real routers over real HTTP, real ``ReplicaSet``\\ s wrapping
fake vLLM servers on loopback (``fake_vllm``), and a real ``redis-server`` where two routers share
state. Each test here failed on the code before it (the attacker's D1-D11, NOTES "Fleet changes").
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, AsyncIterator

import aiohttp
import pytest

from replicas.config import ReplicaSetConfig
from replicas.replica_set import ReplicaSet
from replicas.supervisor import SupervisionConfig
from router import keys
from router.config import AppConfig
from router.server import running_router
from tests.router.edge_fixtures import tiny_tokenizer
from tests.router.fake_vllm import FakeVllm, serving

pytestmark = pytest.mark.asyncio(loop_scope="session")

TOKEN = "fleet-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
QUIET = SupervisionConfig(enabled=False)


@contextlib.asynccontextmanager
async def fakes(n: int, **kw: Any) -> AsyncIterator[tuple[list[FakeVllm], list[str]]]:
    """``n`` fake vLLM servers on loopback: ``(servers, base URLs)``."""
    servers = [FakeVllm(**kw) for _ in range(n)]
    async with contextlib.AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(serving(f)) for f in servers]
        yield servers, urls


@contextlib.asynccontextmanager
async def router(urls: list[str], supervision: SupervisionConfig = QUIET, redis_url: str | None = None,
                 prefix: str = "fc:", **over: Any) -> AsyncIterator[tuple[str, Any, ReplicaSet]]:
    """A router (``rollout-router serve``'s wiring) over a ReplicaSet wrapping ``urls``:
    ``(base URL, app, replica set)``. ``redis_url``: shared state under ``prefix``."""
    state = {"state": "redis", "redis_url": redis_url, "redis_prefix": prefix, "state_sync_interval_s": 0.1,
             "redis_timeout_s": 1.0} if redis_url else {}
    cfg = AppConfig().replace(router={"port": 0, "scrape_interval_s": 0, "admin_token": TOKEN, "kv_events": False,
                                      **state, **over})
    async with ReplicaSet(ReplicaSetConfig(urls=tuple(urls)), supervision=supervision) as rs:
        async with running_router(cfg, rs.endpoints, tiny_tokenizer(), replica_set=rs) as (url, app):
            yield url, app, rs


async def call(method: str, url: str, **kw: Any) -> tuple[int, Any, dict]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        async with http.request(method, url, **kw) as r:
            return r.status, await r.json(content_type=None), dict(r.headers)


async def fleet_of(url: str) -> dict[str, str]:
    status, body, _ = await call("GET", url + "/admin/replicas", headers=ADMIN)
    assert status == 200, body
    return {r["replica"]: r["url"] for r in body["replicas"]}


async def until(check, timeout_s: float = 5.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.05)


async def test_one_server_is_one_replica_however_its_url_is_spelt_or_however_many_ask_at_once():
    async with fakes(2) as (_, (u0, u1)), router([u0]) as (url, app, rs):
        port = u0.rsplit(":", 1)[1]
        # 0.0.0.0 and the IPv4-mapped [::ffff:127.0.0.1] reach it too (an attacker gave it three ids so)
        for spelling in (f"http://localhost:{port}", f" {u0}/ ", f"HTTP://127.0.0.1:{port}//", f"{u0}\n",
                         f"http://0.0.0.0:{port}", f"http://[::ffff:127.0.0.1]:{port}", f"http://[::1]:{port}"):
            status, body, _ = await call("POST", url + "/admin/replicas", json={"url": spelling}, headers=ADMIN)
            assert status == 400 and body["error"]["param"] == "url" and "already a replica" in body["error"]["message"]
        answers = await asyncio.gather(*(call("POST", url + "/admin/replicas", json={"url": u1}, headers=ADMIN)
                                         for _ in range(5)))
        assert sorted(status for status, _, _ in answers) == [201, 400, 400, 400, 400], answers
        assert await fleet_of(url) == {"replica-0": u0, "replica-1": u1}


async def test_a_url_that_is_not_a_replica_of_this_fleet_is_refused_naming_the_url_and_uses_no_id():
    async with fakes(1) as (_, (u0,)), fakes(1, model="another-model") as (_, (other,)), router([u0]) as (url, app, rs):
        from aiohttp import web

        garbage = web.Application()  # answers /health, but its /metrics is not Prometheus text
        garbage.router.add_get("/health", _ok)
        garbage.router.add_get("/metrics", _not_metrics)
        runner = web.AppRunner(garbage)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        garbage_url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        try:
            cases = {
                "http://user:secret@127.0.0.1:1": "credentials",
                "http://" + "a" * 70 + ".example:1": "host name",
                "http://127.0.0.1:1/?x=1": "query",
                "http://127.0.0.1:99999": "URL",
                garbage_url: "Prometheus",
                other: "'another-model' but the fleet serves 'fake-gpu-model'",
            }
            for bad, why in cases.items():
                status, body, _ = await call("POST", url + "/admin/replicas", json={"url": bad}, headers=ADMIN)
                assert status == 400 and body["error"]["param"] == "url" and why in body["error"]["message"], (bad, body)
                assert "secret" not in body["error"]["message"]
        finally:
            await runner.cleanup()
        async with fakes(1) as (_, (good,)):
            status, body, _ = await call("POST", url + "/admin/replicas", json={"url": good}, headers=ADMIN)
            assert status == 201 and body == {"replica": "replica-1", "url": good}  # no id spent on the refusals


async def test_an_unknown_field_is_refused_and_an_add_whose_client_left_still_joins(caplog):
    # a fresh attacker: {"bogus": 1} (or a misspelt url) launched a replica, and a client that
    # left while a launch ran left its vLLM server running outside the fleet (aiohttp cancelled
    # the handler halfway: unsupervised, unrouted, holding its memory)
    async with fakes(2) as (servers, (u0, u1)), router([u0]) as (url, app, rs):
        for body, param in (({"ur1": u1}, "ur1"), ({"url": u1, "model": "x"}, "model")):
            status, answer, _ = await call("POST", url + "/admin/replicas", json=body, headers=ADMIN)
            assert status == 400 and answer["error"]["param"] == param, answer
        assert await fleet_of(url) == {"replica-0": u0}
        servers[1].hang()  # the add's probe of it waits
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.5)) as http:
            with pytest.raises(asyncio.TimeoutError):
                await http.post(url + "/admin/replicas", json={"url": u1}, headers=ADMIN)
        await asyncio.sleep(0.3)  # the router has seen the client go
        servers[1].resume()

        async def joined() -> bool:
            return await fleet_of(url) == {"replica-0": u0, "replica-1": u1}
        await until(joined, 10, "the add its client left finishes and the replica joins")
    assert [r for r in caplog.records if "whose client left, succeeded" in r.getMessage()], caplog.text[-2000:]


async def test_a_restarting_replica_is_listed_out_of_rotation_with_why_until_it_is_back_in_both_admin_views():
    # a fresh attacker: for the whole restart (67-154 s) /admin/replicas listed the dead replica
    # in rotation with no reason (routing skipped it: it was unhealthy)
    from replicas.events import ReplicaEvent
    from router.fleet import on_replica_event

    async with fakes(1) as (_, (u0,)), router([u0]) as (url, app, rs):
        endpoint = rs.endpoints[0]
        on_replica_event(app, ReplicaEvent("restarting", endpoint.replica_id, endpoint, "its server process is gone"))
        _, body, _ = await call("GET", url + "/admin/replicas", headers=ADMIN)
        row, = body["replicas"]
        assert (row["healthy"], row["in_rotation"], row["out_of_rotation_reason"]) == (
            False, False, "restarting: its server process is gone"), row
        # a second attacker: GET /admin/weights said the dead replica was serving, in rotation
        _, weights, _ = await call("GET", url + "/admin/weights", headers=ADMIN)
        shown = weights["replicas"][endpoint.replica_id]
        assert (shown["phase"], shown["in_rotation"], shown["out_of_rotation_reason"]) == (
            "out", False, "restarting: its server process is gone"), shown
        on_replica_event(app, ReplicaEvent("restarted", endpoint.replica_id, endpoint))
        _, body, _ = await call("GET", url + "/admin/replicas", headers=ADMIN)
        row, = body["replicas"]
        assert (row["healthy"], row["in_rotation"], row["out_of_rotation_reason"]) == (True, True, None), row
        _, weights, _ = await call("GET", url + "/admin/weights", headers=ADMIN)
        shown = weights["replicas"][endpoint.replica_id]
        assert (shown["phase"], shown["in_rotation"], shown["out_of_rotation_reason"]) == ("serving", True, None), shown


async def test_a_probe_in_flight_on_a_replica_being_restarted_is_cancelled_at_once():
    # a fresh attacker: /admin/replicas listed "probing: true" ~17 s into a restart, for a probe
    # sent to the hung engine before it; that probe also kept the next one from being sent
    from replicas.events import ReplicaEvent
    from router.fleet import on_replica_event

    async with fakes(1) as (servers, (u0,)):
        servers[0].stall()  # hung while idle: the probe never gets an answer
        cfg = AppConfig().replace(router={"port": 0, "scrape_interval_s": 0.1, "admin_token": TOKEN, "kv_events": False},
                                  policy={"stall_timeout_s": 60.0, "stall_probe_after_s": 0.2})
        async with ReplicaSet(ReplicaSetConfig(urls=(u0,)), supervision=QUIET) as rs:
            async with running_router(cfg, rs.endpoints, tiny_tokenizer(), replica_set=rs) as (url, app):
                endpoint = rs.endpoints[0]

                async def row() -> dict:
                    _, body, _ = await call("GET", url + "/admin/replicas", headers=ADMIN)
                    return body["replicas"][0]

                deadline = time.monotonic() + 20
                while not (await row())["probing"]:
                    assert time.monotonic() < deadline, "no probe was sent to the idle engine"
                    await asyncio.sleep(0.05)
                assert [b["prompt"] for b in servers[0].bodies] == [[0]]
                on_replica_event(app, ReplicaEvent("restarting", endpoint.replica_id, endpoint, "its engine hung"))
                assert not (await row())["probing"]  # at once, not when the old server dies
                cancelled = app[keys.METRICS].probes.labels(endpoint.replica_id, "cancelled")
                while cancelled._value.get() != 1:  # counted as its task unwinds
                    assert time.monotonic() < deadline, cancelled._value.get()
                    await asyncio.sleep(0.01)
                servers[0].resume()
                on_replica_event(app, ReplicaEvent("restarted", endpoint.replica_id, endpoint))
                while len(servers[0].bodies) < 2:  # the slot is free: the new engine is probed in its turn
                    assert time.monotonic() < deadline, "the replica back from its restart was never probed"
                    await asyncio.sleep(0.05)


async def _ok(_):
    from aiohttp import web
    return web.Response()


async def _not_metrics(_):
    from aiohttp import web
    return web.Response(text="{{{ not metrics")


async def test_after_the_last_replica_left_the_router_still_names_its_model_and_answers_503_then_takes_a_new_one():
    async with fakes(2) as (_, (u0, u1)), router([u0]) as (url, app, rs):
        status, body, _ = await call("DELETE", url + "/admin/replicas/replica-0?drain_s=0", headers=ADMIN)
        assert status == 200 and body["drained"] is True  # idle: a drain of 0 s is a drained one
        status, body, _ = await call("GET", url + "/v1/models")
        assert status == 200 and [m["id"] for m in body["data"]] == ["fake-gpu-model"]
        status, body, _ = await call("POST", url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1})
        assert status == 503, body
        status, body, _ = await call("POST", url + "/admin/replicas", json={"url": u1}, headers=ADMIN)
        assert status == 201
        status, body, headers = await call("POST", url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1})
        assert status == 200 and headers["X-Rollout-Replica"] == "replica-1"


async def test_requests_on_a_replica_that_hangs_run_elsewhere_and_a_removed_ones_gauges_stay_gone():
    fast = SupervisionConfig(interval_s=0.2, health_timeout_s=0.5, restart_after_failures=1000)
    async with fakes(2) as (servers, urls), router(urls, fast, request_timeout_s=120) as (url, app, rs):
        core = app[keys.CORE]
        servers[1].hang()
        started = time.monotonic()
        answers, streams = await asyncio.gather(
            asyncio.gather(*(call("POST", url + "/v1/completions", json={"prompt": [7, 8, i], "max_tokens": 1})
                             for i in range(8))),
            asyncio.gather(*(_stream(url, [7, 9, i]) for i in range(4))))
        took = time.monotonic() - started
        assert [a[0] for a in answers] == [200] * 8, answers
        assert {a[2]["X-Rollout-Replica"] for a in answers} == {"replica-0"}
        # streams too: none had sent a byte, so each runs whole on the replica that answers
        assert [s[0] for s in streams] == [200] * 4 and {s[1] for s in streams} == {"replica-0"}, streams
        assert all(s[2].endswith("data: [DONE]\n\n") and '" w0"' in s[2] for s in streams), streams
        assert len(servers[1].bodies) > 0  # some were sent there first, and ran again elsewhere
        assert took < 10, took  # the supervisor's failed health check (0.5 s), not request_timeout_s
        assert not core.replicas["replica-1"].healthy
        # removed at once while requests hang there: they run elsewhere, its gauges do not come back
        servers[0].delay_s = 0.3
        for rid in core.replicas:
            core.set_health(rid, True)
        pending = [asyncio.ensure_future(call("POST", url + "/v1/completions",
                                              json={"prompt": [9, 9, i], "max_tokens": 1, "session_id": f"s{i}"}))
                   for i in range(6)]
        await until(lambda: _sent_to(servers[1], 9), what="a request reached the hung replica")
        status, _, _ = await call("DELETE", url + "/admin/replicas/replica-1", headers=ADMIN)
        assert status == 200
        answers = await asyncio.gather(*pending)
        assert [a[0] for a in answers] == [200] * 6 and {a[2]["X-Rollout-Replica"] for a in answers} == {"replica-0"}
        servers[1].resume()
        status, text = await _metrics(url)
        gone = [line for line in text.splitlines() if 'replica="replica-1"' in line and not line.startswith("#")
                and line.split("{")[0] in ("rollout_router_in_flight", "rollout_router_prefix_cache_hit_rate",
                                           "rollout_router_kv_cache_usage")]
        assert status == 200 and gone == []
        assert "replica-1" not in core.admission.ledger.requests_by_replica


async def _stream(url: str, prompt: list[int]) -> tuple[int, str | None, str]:
    """A streamed completion: ``(status, replica, the whole event stream)``."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        async with http.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1, "stream": True}) as r:
            return r.status, r.headers.get("X-Rollout-Replica"), (await r.read()).decode()


async def _sent_to(server: FakeVllm, first: int) -> bool:
    return any(b["prompt"][0] == first for b in server.bodies) and server.in_flight > 0


async def _metrics(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/metrics") as r:
            return r.status, await r.text()


# -- two routers sharing state -------------------------------------------------------------------

async def test_two_routers_adding_at_once_give_distinct_ids_and_a_removal_through_either_is_everywhere(redis_url):
    async with fakes(4) as (servers, (u0, u1, u2, u3)), \
            router([u0, u1], redis_url=redis_url, prefix="fc2:") as (a, app_a, rs_a), \
            router([u0, u1], redis_url=redis_url, prefix="fc2:") as (b, app_b, rs_b):
        (sa, ba, _), (sb, bb, _) = await asyncio.gather(
            call("POST", a + "/admin/replicas", json={"url": u2}, headers=ADMIN),
            call("POST", b + "/admin/replicas", json={"url": u3}, headers=ADMIN))
        assert (sa, sb) == (201, 201) and ba["replica"] != bb["replica"], (ba, bb)
        want = {"replica-0": u0, "replica-1": u1, ba["replica"]: u2, bb["replica"]: u3}

        async def both_see(fleet):
            return await fleet_of(a) == fleet and await fleet_of(b) == fleet

        await until(lambda: both_see(want), what=f"both routers list {want}")
        # B removes the replica A added: A drops it and its replica set lets it go
        status, body, _ = await call("DELETE", f"{b}/admin/replicas/{ba['replica']}", headers=ADMIN)
        assert status == 200, body
        del want[ba["replica"]]
        await until(lambda: both_see(want), what="the removal reached A")
        await until(lambda: _not_owned(rs_a, ba["replica"]), what="A's replica set let it go")
        # and the last ones too: a fleet of none is shared, not undone by the other router
        for rid in sorted(want):
            owner = a if rs_a.owns(rid) else b
            status, body, _ = await call("DELETE", f"{owner}/admin/replicas/{rid}", headers=ADMIN)
            assert status == 200, body
        await until(lambda: both_see({}), what="both routers have no replica")


async def _not_owned(rs: ReplicaSet, rid: str) -> bool:
    return not rs.owns(rid)


async def test_a_drain_on_one_router_waits_for_the_requests_another_router_runs_there(redis_url):
    async with fakes(2) as (servers, urls), \
            router(urls, redis_url=redis_url, prefix="fc3:") as (a, app_a, _), \
            router(urls, redis_url=redis_url, prefix="fc3:") as (b, app_b, _):
        for s in servers:
            s.delay_s = 2.0
        finished: list[tuple[str, int, float]] = []

        async def through_b(i: int) -> None:
            status, _, headers = await call("POST", b + "/v1/completions", json={"prompt": [3, 4, i], "max_tokens": 1})
            finished.append((headers.get("X-Rollout-Replica"), status, time.monotonic()))

        pending = [asyncio.ensure_future(through_b(i)) for i in range(4)]
        core_b = app_b[keys.CORE]
        await until(lambda: _any_in_flight(core_b), what="B has requests in flight")
        rid = max(core_b.replicas, key=core_b.in_flight)
        status, body, _ = await call("DELETE", f"{a}/admin/replicas/{rid}?drain_s=30", headers=ADMIN)
        answered = time.monotonic()
        await asyncio.gather(*pending)
        assert status == 200 and body["drained"] is True, body
        there = [t for r, _, t in finished if r == rid]
        assert there and max(there) <= answered, (finished, answered)  # drained only once B's were done
        assert all(s == 200 for _, s, _ in finished), finished


async def _any_in_flight(core) -> bool:
    return any(core.in_flight(r) for r in core.replicas)


async def test_one_server_added_through_two_routers_at_once_is_one_replica(redis_url):
    async with fakes(3) as (_, (u0, u1, u2)), \
            router([u0, u1], redis_url=redis_url, prefix="fc4:") as (a, _, _), \
            router([u0, u1], redis_url=redis_url, prefix="fc4:") as (b, _, _):
        port = u2.rsplit(":", 1)[1]
        answers = await asyncio.gather(
            call("POST", a + "/admin/replicas", json={"url": f"http://localhost:{port}"}, headers=ADMIN),
            call("POST", b + "/admin/replicas", json={"url": f"{u2}/"}, headers=ADMIN))
        assert sorted(status for status, _, _ in answers) == [201, 400], answers
        refused = next(body for status, body, _ in answers if status == 400)
        assert refused["error"]["param"] == "url", refused
        # and right after, before a sync round could carry it: the other router still refuses it
        status, body, _ = await call("POST", b + "/admin/replicas", json={"url": u2}, headers=ADMIN)
        assert status == 400 and body["error"]["param"] == "url", body

        async def both_have_three():
            return len(await fleet_of(a)) == 3 and len(await fleet_of(b)) == 3

        await until(both_have_three, what="both routers list the one new replica")


async def test_a_replica_added_while_requests_queue_takes_the_queued_ones():
    # replica-0 (100 blocks of 16 tokens, watermark 85) runs one 1,000-token prompt and hangs;
    # two more queue behind it. Before, a replica added now got none of them: they waited for
    # replica-0 until queue_timeout_s and got 429s. Now the first moves there at once (an idle
    # replica admits one) and the second once the first has ended there (two do not fit 85 blocks).
    async with fakes(2, num_gpu_blocks=100) as (servers, (u0, u1)), router([u0], request_timeout_s=120) as (url, app, rs):
        core = app[keys.CORE]
        servers[0].hang()
        prompts = [[(7 * i + j) % 500 + 1 for j in range(1000)] for i in range(3)]
        first = asyncio.ensure_future(call("POST", url + "/v1/completions", json={"prompt": prompts[0], "max_tokens": 16}))
        await until(lambda: _sent_to(servers[0], prompts[0][0]), what="the first request reached replica-0")
        queued = [asyncio.ensure_future(call("POST", url + "/v1/completions", json={"prompt": p, "max_tokens": 16}))
                  for p in prompts[1:]]

        async def both_queued() -> bool:
            return core.queue_length() == 2
        await until(both_queued, what="two requests queued behind replica-0")
        status, body, _ = await call("POST", url + "/admin/replicas", json={"url": u1}, headers=ADMIN)
        assert status == 201 and body["replica"] == "replica-1"
        answers = await asyncio.wait_for(asyncio.gather(*queued), timeout=10)  # replica-0 still hangs
        assert [a[0] for a in answers] == [200, 200], answers
        assert [a[2]["X-Rollout-Replica"] for a in answers] == ["replica-1", "replica-1"]
        assert [b["prompt"][0] for b in servers[1].bodies] == [prompts[1][0], prompts[2][0]]  # in queue order
        assert not first.done() and core.queue_length() == 0
        servers[0].resume()
        status, _, headers = await first
        assert status == 200 and headers["X-Rollout-Replica"] == "replica-0"


async def test_a_router_whose_replica_ids_mean_other_servers_on_the_shared_registry_does_not_start(redis_url):
    # ids of replicas.urls are positional: B listing [u0, u2] while A (alive) lists [u0, u1] gave
    # replica-1 two servers. Before, B silently followed A's entry as a restart (its u2 never used)
    # or, writing first, moved A's replica-1 to u2. Now B refuses to start, naming both, and A's
    # fleet stays as configured; once A is gone, a router with the other list takes the ids over.
    from replicas.config import StartupError

    async with fakes(3) as (_, (u0, u1, u2)):
        async with router([u0, u1], redis_url=redis_url, prefix="fc5:") as (a, app_a, _):
            with pytest.raises(StartupError, match=rf"replica-1 is {u1} on router .*same replicas.urls in the same order"):
                async with router([u0, u2], redis_url=redis_url, prefix="fc5:"):
                    pass
            await asyncio.sleep(0.5)  # a few of A's sync rounds
            assert await fleet_of(a) == {"replica-0": u0, "replica-1": u1}
        async with router([u0, u2], redis_url=redis_url, prefix="fc5:") as (b, app_b, _), \
                router([u0, u2], redis_url=redis_url, prefix="fc5:") as (c, app_c, _):
            assert await fleet_of(b) == await fleet_of(c) == {"replica-0": u0, "replica-1": u2}
            status, _, headers = await call("POST", c + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1})
            assert status == 200


async def test_the_same_servers_spelt_otherwise_on_another_router_are_no_conflict(redis_url):
    # `localhost` on one router, 127.0.0.1 on the other: the same servers under the same ids (an
    # attacker's case: refused to start as a conflict); each keeps its spelling, nothing is rewritten
    async with fakes(2) as (_, (u0, u1)):
        spelt = [u.replace("127.0.0.1", "localhost") for u in (u0, u1)]
        async with router([u0, u1], redis_url=redis_url, prefix="fc6:") as (a, app_a, _), \
                router(spelt, redis_url=redis_url, prefix="fc6:") as (b, app_b, _):
            await asyncio.sleep(0.5)  # a few sync rounds each
            seqs = dict(app_a[keys.LIFECYCLE].shared.registry.seq)
            await asyncio.sleep(0.5)
            assert app_a[keys.LIFECYCLE].shared.registry.seq == seqs  # no tug of war
            assert await fleet_of(a) == {"replica-0": u0, "replica-1": u1}
            assert await fleet_of(b) == {"replica-0": spelt[0], "replica-1": spelt[1]}
            for url in (a, b):
                status, _, _ = await call("POST", url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1})
                assert status == 200


async def test_a_server_another_router_launched_is_not_added_again_under_a_second_id(redis_url):
    # another router's launched replica needs a key only that router's process holds, so this
    # router does not follow its registry entry; a POST of its URL gave the server a second id
    # (an attacker's case, session 23), two routers then counting one engine twice
    from aiohttp import web

    from cache_policy.config import PolicyConfig
    from cache_policy.core import DecisionCore
    from cache_policy.types import ReplicaId
    from replicas.replica_set import ReplicaEndpoint
    from router.pool import ReplicaPool
    from router.state import RedisState

    async with fakes(2) as (_, (u0, u2)):
        async with router([u0], redis_url=redis_url, prefix="fc7:") as (b, app_b, _):
            # the other router, as router.app wires its state: a core, a pool, a RedisState
            launched = ReplicaEndpoint(ReplicaId("replica-5"), u2, 16, 2000, "fake-gpu-model", api_key="secret")
            other = web.Application()
            other[keys.CORE] = DecisionCore(PolicyConfig())
            other[keys.CORE].add_replica(launched.replica_id, block_size=16, num_gpu_blocks=2000)
            other[keys.POOL] = ReplicaPool([launched])
            state = RedisState(redis_url, prefix="fc7:", timeout_s=1.0, sync_interval_s=0.1)
            state.app = other
            try:
                await state.sync_round()
                registry = app_b[keys.LIFECYCLE].shared.registry
                await until(lambda: asyncio.sleep(0, "replica-5" in registry.unreachable), what="B reads the entry")
                spelt = u2.replace("127.0.0.1", "localhost")
                status, body, _ = await call("POST", b + "/admin/replicas", json={"url": spelt}, headers=ADMIN)
                assert status == 400 and body["error"]["param"] == "url", body
                assert f"is already replica-5 of another router (as {u2})" in body["error"]["message"]
                assert await fleet_of(b) == {"replica-0": u0}
            finally:
                await state.close()


async def test_two_routers_started_at_once_with_different_lists_do_not_both_start(redis_url):
    # both read the registry before either wrote it, so both passed the start check and each took
    # replica-1 for its own server (session 23's known gap); now a joining router's write does not
    # take an id another live router holds at another URL, and the later one refuses to start
    from replicas.config import StartupError

    async with fakes(3) as (_, (u0, u1, u2)):
        for attempt in range(3):
            prefix = f"fc8-{attempt}:"
            release = asyncio.Event()
            started: list[tuple[str, str]] = []

            async def one(urls: list[str]) -> None:
                async with router(urls, redis_url=redis_url, prefix=prefix) as (url, _, _):
                    started.append((url, urls[1]))
                    await release.wait()

            tasks = [asyncio.create_task(one(urls)) for urls in ([u0, u1], [u0, u2])]
            await until(lambda: asyncio.sleep(0, len(started) + sum(t.done() for t in tasks) == 2), 30,
                        "both routers started or refused")
            refused = [t.exception() for t in tasks if t.done()]
            assert len(started) == 1 and len(refused) == 1, (started, refused)
            assert isinstance(refused[0], StartupError) and "replica-1 is" in str(refused[0])
            url, mine = started[0]
            await asyncio.sleep(0.5)  # a few sync rounds: nothing moved under the router that runs
            assert await fleet_of(url) == {"replica-0": u0, "replica-1": mine}
            release.set()
            await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_claim_whose_answer_was_lost_does_not_hold_the_server_for_two_minutes(tmp_path):
    # Redis hung while a router claimed a server's address: the claim timed out (503) but landed
    # when Redis came back, and that hold refused adding the server from every router for
    # ADD_HOLD_S (120 s). Now the claiming router lets go of it once Redis answers.
    from tests.router.ha_redis import RedisProcess

    redis = RedisProcess(tmp_path).start()
    try:
        async with fakes(2) as (_, (u0, u1)):
            fast = {"redis_timeout_s": 0.1}  # background calls (the claim) time out after 1 s
            async with router([u0], redis_url=redis.url, prefix="fc9:", **fast) as (a, _, _), \
                    router([u0], redis_url=redis.url, prefix="fc9:", **fast) as (b, _, _):
                redis.stop()
                try:
                    status, body, _ = await call("POST", a + "/admin/replicas", json={"url": u1}, headers=ADMIN)
                finally:
                    redis.cont()
                assert status == 503, body  # the claim got no answer in time
                added = None
                for _ in range(100):  # within seconds, not the 120 s hold
                    status, body, _ = await call("POST", b + "/admin/replicas", json={"url": u1}, headers=ADMIN)
                    if status == 201:
                        added = body
                        break
                    assert status in (400, 503), body
                    assert status == 503 or "is being added through another router" in body["error"]["message"], body
                    await asyncio.sleep(0.1)
                assert added is not None and added["url"] == u1, "the lost claim still holds the server"
    finally:
        redis.close()



async def test_the_routers_own_address_is_refused_as_a_replica_however_spelt():
    # a fresh attacker added the router as its own replica (201): requests then looped through it
    # (1,334 times in 15 s for one completion, 574 open descriptors)
    async with fakes(1) as (_, (u0,)), router([u0]) as (url, app, rs):
        port = url.rsplit(":", 1)[1]
        for spelling in (url, f"http://localhost:{port}", f"http://0.0.0.0:{port}/", f"http://[::ffff:127.0.0.1]:{port}"):
            status, body, _ = await call("POST", url + "/admin/replicas", json={"url": spelling}, headers=ADMIN)
            assert status == 400 and body["error"]["param"] == "url", body
            assert "this router itself" in body["error"]["message"], body
        assert await fleet_of(url) == {"replica-0": u0}
