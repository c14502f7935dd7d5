"""What a fresh user of the HTTP edge found (edge8): the router's answers tell the truth and have
one shape. Real HTTP on loopback, a fake replica (tests/router/edge_fixtures.py); no vLLM."""

from __future__ import annotations

import aiohttp
import pytest

from tests.router.edge_fixtures import edge_router, fake_replica, post

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def call(method: str, url: str, *, json=None, headers=None) -> tuple[int, dict, aiohttp.typedefs.LooseHeaders]:
    """``(status, JSON body, headers)`` of one request."""
    async with aiohttp.ClientSession() as http, http.request(method, url, json=json, headers=headers) as r:
        return r.status, await r.json(content_type=None), r.headers


async def test_deleting_a_session_the_router_never_saw_says_it_ended_nothing():
    async with fake_replica() as replica, edge_router(replica) as (url, _):
        status, body, _ = await call("DELETE", url + "/v1/sessions/never-seen")
        assert (status, body["session_id"], body["ended"]) == (200, "never-seen", False), body
        assert "never-seen" in body["message"]

        status, _ = await post(url, "/v1/completions", json={"prompt": [5, 6]}, headers={"X-Session-Id": "s1"})
        assert status == 200
        status, body, _ = await call("DELETE", url + "/v1/sessions/s1")
        assert (status, body) == (200, {"session_id": "s1", "ended": True})
        status, body, _ = await call("DELETE", url + "/v1/sessions/s1")  # already ended
        assert (status, body["ended"]) == (200, False)
        status, body, _ = await call("DELETE", url + "/v1/sessions/" + "s" * 300)
        assert (status, body["error"]["param"], body["error"]["type"]) == (400, "session_id", "invalid_request_error")
