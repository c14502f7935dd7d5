"""A new version reaches every router's streams before the engine resumes (``keep``): the
updater publishes it while the replica is paused and waits until each other router applied it
and marked its own kept streams' spans (``RedisState.await_marked``, ``Lifecycle.mark_new_spans``).
A fresh attacker saw every stream relayed by a router that did not run the update claim only the
old version for tokens the new weights computed. Two served routers, a real redis-server."""

from __future__ import annotations

import itertools

import aiohttp
import pytest

from cache_policy.core import RequestSpec
from cache_policy.types import ReplicaId
from router import keys
from router.lifecycle import Flight, Rerun
from router.weights.report import first_span, version_note
from tests.router.edge_fixtures import edge_router, fake_replica

pytestmark = pytest.mark.asyncio(loop_scope="session")

R0 = ReplicaId("replica-0")
_prefixes = itertools.count()


def _kept_stream(app, tokens: int) -> Flight:
    """A stream ``app``'s router relays from replica-0 (as ``Lifecycle._fly`` registers one); with
    ``tokens``, its first token went to the client (``Lifecycle.answer_starts``)."""
    core, life = app[keys.CORE], app[keys.LIFECYCLE]
    job = core.open(RequestSpec(list(range(100, 164))), 0.0)
    core.place(job, 0.0)
    assert core.admit(job, 0.0).verdict == "admit"
    flight = Flight(job, True, spans=[first_span(core, job)], tokens={0: tokens})
    if tokens:
        core.answering(job)
    life.flights.setdefault(R0, {})[job.id] = flight
    return flight


def _update(app, version: int) -> None:
    core = app[keys.CORE]
    core.set_rotation(R0, "updating")
    core.version_loaded(R0, version)
    core.finish_update(version, "keep+salt")


@pytest.mark.parametrize("recomputed", [False, True])
async def test_another_routers_kept_stream_enters_the_new_span_before_the_updater_resumes(redis_url, recomputed):
    shared = {"state": "redis", "redis_url": redis_url, "redis_prefix": f"sp{next(_prefixes)}:",
              "state_sync_interval_s": 0.1}
    async with fake_replica() as replica, edge_router(replica, **shared) as (_, a), \
            edge_router(replica, **shared) as (_, b):
        state_a = a[keys.LIFECYCLE].shared
        stream = _kept_stream(b, tokens=7)
        unstarted = _kept_stream(b, tokens=0)  # before its first token: it runs again at it instead
        _update(a, 1)
        assert await state_a.publish_versions(a[keys.CORE], {R0: recomputed})
        assert await state_a.await_marked(timeout_s=5.0) == []
        # b's stream is in the new span already: what the engine computes after the resume is v1's
        assert [s["weight_version"] for s in stream.spans] == [0, 1]
        assert [s["weight_version"] for s in unstarted.spans] == [0]
        with pytest.raises(Rerun):
            b[keys.LIFECYCLE].answer_starts(unstarted.job)
        assert stream.spans[1]["from_token"] == {0: 7}
        assert stream.spans[1]["hybrid"] is (not recomputed)
        note = version_note(b[keys.CORE], stream.job, stream.spans, cached=None, tokens={0: 12})
        assert note["weight_versions"] == [0, 1] and note["weight_version"] == 1


async def test_a_router_that_does_not_confirm_is_named_not_waited_for_forever(redis_url):
    shared = {"state": "redis", "redis_url": redis_url, "redis_prefix": f"sp{next(_prefixes)}:",
              "state_sync_interval_s": 0.1}
    async with fake_replica() as replica, edge_router(replica, **shared) as (_, a), \
            edge_router(replica, **shared) as (_, b):
        state_a, state_b = a[keys.LIFECYCLE].shared, b[keys.LIFECYCLE].shared
        state_b.versions.on_applied = lambda *_: None  # b applies versions but never confirms them
        _update(a, 1)
        assert await state_a.publish_versions(a[keys.CORE], {R0: False})
        assert await state_a.await_marked(timeout_s=0.5) == [state_b.router_id]


async def test_a_commit_sent_to_another_router_names_the_router_that_began_the_update(redis_url):
    """A two-phase update runs on the router that began it; a commit sent to another router is a
    409 that names that router (it said only "POST begin first", which the trainer had done)."""
    shared = {"state": "redis", "redis_url": redis_url, "redis_prefix": f"sp{next(_prefixes)}:",
              "state_sync_interval_s": 0.1, "admin_token": "tok"}
    async with fake_replica() as replica, edge_router(replica, **shared) as (url_a, a), \
            edge_router(replica, **shared) as (url_b, b):
        state_a = a[keys.LIFECYCLE].shared
        assert await state_a.acquire_update_lock(f"{state_a.router_id}:41", 30.0)  # as a's begin takes it
        await state_a.sync_round()  # its heartbeat carries its address
        async with aiohttp.ClientSession() as http:
            async with http.post(url_b + "/admin/weights/commit", json={"version": 41},
                                 headers={"Authorization": "Bearer tok"}) as r:
                assert r.status == 409
                message = (await r.json())["error"]["message"]
        assert state_a.router_id in message and "began" in message and f"at {url_a}:" in message
