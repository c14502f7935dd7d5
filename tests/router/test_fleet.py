"""The router follows replica events (no vLLM): new URLs, forgotten caches, drains, removals.

A real ``EventBus`` publishes the events a ``ReplicaSet`` publishes; the router app is real.
"""

from __future__ import annotations

import pytest
from aiohttp.test_utils import TestClient, TestServer

from cache_policy.core import RequestSpec
from cache_policy.types import ReplicaId
from replicas.events import EventBus
from replicas.replica_set import ReplicaEndpoint
from router import keys
from router.app import create_app
from router.config import AppConfig
from router.fleet import attach_fleet
from tests.router.edge_fixtures import tiny_tokenizer

pytestmark = pytest.mark.asyncio(loop_scope="function")
A, B = ReplicaId("replica-0"), ReplicaId("replica-1")


class FakeFleet:
    """The part of ReplicaSet the router uses: ``subscribe`` and ``events``."""

    def __init__(self) -> None:
        self.events = EventBus()

    def subscribe(self, handler):
        return self.events.subscribe(handler)


def _ep(rid, port, blocks=1000):
    return ReplicaEndpoint(rid, f"http://127.0.0.1:{port}", 32, blocks, "tiny-llama")


async def test_restart_new_url_forgets_cache_and_pins_drain_and_remove():
    cfg = AppConfig().replace(router={"port": 0, "scrape_interval_s": 0, "kv_events": False})
    app = create_app(cfg, [_ep(A, 9), _ep(B, 10)], tiny_tokenizer())
    fleet = FakeFleet()
    attach_fleet(app, fleet)
    async with TestClient(TestServer(app)):
        core = app[keys.CORE]
        job = core.open(RequestSpec(list(range(500)), session_id="s"), 0.0)
        rid = core.place(job, 0.0).replica_id
        core.admit(job, 0.0)
        core.finish(job, "ok", 0.0)
        assert core.prefix_index().blocks_of(rid) > 0 and core.registry.get("session", "s").replica == rid

        fleet.events.publish("restarting", rid, _ep(rid, 9))
        await fleet.events.flush()
        assert not core.replicas[rid].healthy
        fleet.events.publish("restarted", rid, _ep(rid, 19, blocks=777))
        await fleet.events.flush()
        assert app[keys.POOL].get(rid).endpoint.base_url == "http://127.0.0.1:19"
        assert core.replicas[rid].healthy and core.replicas[rid].num_gpu_blocks == 777
        assert core.prefix_index().blocks_of(rid) == 0 and core.registry.get("session", "s") is None

        other = B if rid == A else A
        fleet.events.publish("draining", other, _ep(other, 10))
        await fleet.events.flush()
        job = core.open(RequestSpec(list(range(900, 1000))), 1.0)
        assert core.place(job, 1.0).replica_id == rid  # a draining replica gets no new work
        core.finish(job, "cancelled", 1.0)
        fleet.events.publish("removed", other, _ep(other, 10))
        await fleet.events.flush()
        assert other not in core.replicas and [s.endpoint.replica_id for s in app[keys.POOL].states()] == [rid]
        core.check_integrity()


async def test_admin_replicas_without_a_fleet_is_a_clear_409():
    cfg = AppConfig().replace(router={"port": 0, "scrape_interval_s": 0, "kv_events": False, "admin_token": "t"})
    app = create_app(cfg, [_ep(A, 9)], tiny_tokenizer())
    attach_fleet(app, None)
    async with TestClient(TestServer(app)) as client:
        r = await client.get("/admin/replicas", headers={"Authorization": "Bearer t"})
        assert r.status == 200 and [x["replica"] for x in (await r.json())["replicas"]] == [A]
        r = await client.post("/admin/replicas", json={}, headers={"Authorization": "Bearer t"})
        assert r.status == 409
        r = await client.delete("/admin/replicas/nope", headers={"Authorization": "Bearer t"})
        assert r.status == 400 and (await r.json())["error"]["param"] == "replica_id"
        r = await client.get("/admin/replicas")
        assert r.status == 401


@pytest.mark.parametrize("status, stream", [(500, False), (401, False), (401, True)])
async def test_a_replica_answering_5xx_before_anything_reached_the_client_is_retried_elsewhere(status, stream):
    """Issue 12: a generation that had sent nothing to its client is retried on another replica.
    A 401 too: the replica refused the router's own key (one stopped under a request while a
    drain was being set up, CI), which the client neither caused nor can mend."""
    from aiohttp import web

    from router.server import running_router
    from tests.loopback import app_on_loopback
    from tests.router.edge_fixtures import fake_replica

    async def broken(_: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "EngineDeadError", "code": status}}, status=status)

    bad = web.Application()
    bad.router.add_post("/v1/completions", broken)
    cfg = AppConfig().replace(router={"port": 0, "scrape_interval_s": 0, "kv_events": False,
                                      "policy": "round_robin"})
    async with app_on_loopback(bad) as bad_url:
        bad_port = int(bad_url.rsplit(":", 1)[1])
        async with fake_replica() as good:
            endpoints = [_ep(A, bad_port), ReplicaEndpoint(B, good.url, 32, 1000, "tiny-llama")]
            async with running_router(cfg, endpoints, tiny_tokenizer()) as (url, app):
                import aiohttp

                async with aiohttp.ClientSession() as http:
                    body = {"prompt": [5] * 40, "max_tokens": 2, "stream": stream}
                    async with http.post(url + "/v1/completions", json=body) as r:
                        assert r.status == 200 and r.headers["X-Rollout-Replica"] == B
                        await r.read()
                assert app[keys.METRICS].retries.labels("failed")._value.get() == 1
                assert len(good.bodies) == 1
                assert app[keys.CORE].replicas[A].failures == 1 and app[keys.CORE].replicas[A].healthy


async def test_admin_replicas_refuses_a_launch_in_router_only_mode_and_a_duplicate_url():
    """A router in front of replicas.urls launches nothing; one server is one replica."""
    from replicas.config import ReplicaSetConfig

    cfg = AppConfig().replace(router={"port": 0, "scrape_interval_s": 0, "kv_events": False, "admin_token": "t"})
    app = create_app(cfg, [_ep(A, 9)], tiny_tokenizer())
    fleet = FakeFleet()
    fleet.cfg = ReplicaSetConfig(urls=("http://127.0.0.1:9",))
    calls = []
    fleet.add = lambda url=None: calls.append(url)  # must never be reached here
    attach_fleet(app, fleet)
    auth = {"Authorization": "Bearer t"}
    async with TestClient(TestServer(app)) as client:
        r = await client.post("/admin/replicas", json={}, headers=auth)
        assert r.status == 400 and (await r.json())["error"]["param"] == "url"
        r = await client.post("/admin/replicas", json={"url": "http://127.0.0.1:9/"}, headers=auth)
        assert r.status == 400 and "already" in (await r.json())["error"]["message"]
        r = await client.delete(f"/admin/replicas/{A}?drain_timeout_s=3", headers=auth)
        assert r.status == 400 and (await r.json())["error"]["param"] == "drain_timeout_s"
        for bad in (b"{not json", b"[1, 2]", b'"http://127.0.0.1:9"'):
            r = await client.post("/admin/replicas", data=bad, headers=auth)
            assert r.status == 400 and (await r.json())["error"]["param"] == "body", bad
    assert calls == []  # nothing was launched or registered


async def test_a_removed_replicas_gauges_go_and_its_healthy_gauge_reads_zero():
    cfg = AppConfig().replace(router={"port": 0, "scrape_interval_s": 0, "kv_events": False})
    app = create_app(cfg, [_ep(A, 9), _ep(B, 10)], tiny_tokenizer())
    fleet = FakeFleet()
    attach_fleet(app, fleet)
    async with TestClient(TestServer(app)) as client:
        m = app[keys.METRICS]
        for rid in (A, B):  # what a scrape round and the requests set for each replica
            m.in_flight.labels(rid).set(2)
            m.kv_usage.labels(rid).set(0.5)
            m.replica_requests.labels(rid, "running").set(3)
            m.replica_requests.labels(rid, "waiting").set(1)
            m.kv_events.labels(rid, "stored").set(7)
            m.prompt_tokens.labels(rid).inc(100)
        fleet.events.publish("removed", B, _ep(B, 10))
        await fleet.events.flush()
        text = await (await client.get("/metrics")).text()
        lines = [line for line in text.splitlines() if not line.startswith("#") and f'replica="{B}"' in line]
        assert sorted(line.split("{")[0] for line in lines) == [
            "rollout_router_prompt_tokens_created", "rollout_router_prompt_tokens_total", "rollout_router_replica_healthy"]
        assert f'rollout_router_replica_healthy{{replica="{B}"}} 0.0' in lines
        assert f'rollout_router_in_flight{{replica="{A}"}} 2.0' in text  # the replica still here keeps its own
        assert f'rollout_router_replica_requests{{replica="{A}",state="waiting"}} 1.0' in text
        m.in_flight.labels(A).set(1)  # the label cache still answers for the others after a removal
        assert f'rollout_router_in_flight{{replica="{A}"}} 1.0' in (await (await client.get("/metrics")).text())
