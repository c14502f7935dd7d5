"""What a fresh user of the HTTP edge found (edge8): the router's answers tell the truth and have
one shape. Real HTTP on loopback, a fake replica (tests/router/edge_fixtures.py); no vLLM."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from router import keys
from router.errors import error_body, error_type
from router.shutdown import SHUTDOWN, refused
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
        for bad in ("s" * 300, "%20%20", "a%0Ab"):  # too long, blank, a control character: as in a request
            status, body, _ = await call("DELETE", url + "/v1/sessions/" + bad)
            assert (status, body["error"]["param"], body["error"]["type"]) == (400, "session_id", "invalid_request_error")


async def test_error_types_follow_openais_names_from_the_status_alone():
    assert {s: error_type(s) for s in (400, 401, 403, 404, 405, 408, 409, 413, 415, 429, 500, 502, 503)} == {
        400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
        404: "invalid_request_error", 405: "invalid_request_error", 408: "invalid_request_error",
        409: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
        429: "rate_limit_error", 500: "server_error", 502: "server_error", 503: "server_error"}
    assert error_body(503, "m") == {"error": {"message": "m", "type": "server_error", "param": None, "code": 503}}


async def test_every_error_the_router_writes_has_the_type_of_its_status():
    async with fake_replica() as replica, edge_router(replica, admin_token="t") as (url, app):
        answers = [
            await call("POST", url + "/v1/completions", json={"prompt": [5, 6], "n": 0}),  # 400 (BadRequest)
            await call("GET", url + "/v1/nowhere"),  # 404 (aiohttp's HTTPNotFound, was "http_error")
            await call("GET", url + "/v1/completions"),  # 405
            await call("GET", url + "/admin/replicas"),  # 401: no admin token
            await call("POST", url + "/admin/replicas", json={}, headers={"Authorization": "Bearer t"}),  # 409
        ]
        app[keys.CORE].set_health("replica-0", False)
        answers.append(await call("POST", url + "/v1/completions", json={"prompt": [5, 6]}))  # 503 (NoReplica)
        app[SHUTDOWN].draining = True
        answers.append(await call("POST", url + "/v1/completions", json={"prompt": [5, 6]}))  # 503 (shutdown)
    statuses = [status for status, _, _ in answers]
    assert statuses == [400, 404, 405, 401, 409, 503, 503], answers
    for status, body, _ in answers:
        assert body["error"]["type"] == error_type(status) and body["error"]["code"] == status, body
        assert set(body["error"]) == {"message", "type", "param", "code"}
    assert [body["error"]["type"] for _, body, _ in answers] == [
        "invalid_request_error", "invalid_request_error", "invalid_request_error", "authentication_error",
        "invalid_request_error", "server_error", "server_error"]
    assert answers[0][1]["error"]["param"] == "n"
    assert answers[-1][2]["Retry-After"] and refused().status == 503


async def test_the_error_event_ending_a_broken_stream_has_the_same_shape():
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from router.proxy import STREAM_ERROR_CODE, _end_with_error

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        await _end_with_error(resp, "replica broke the stream")
        return resp

    app = web.Application()
    app.router.add_get("/", handler)
    async with TestClient(TestServer(app)) as client:
        text = await (await client.get("/")).text()
    event = json.loads(text.split("data: ")[1])
    assert event == error_body(STREAM_ERROR_CODE, "replica broke the stream")
    assert event["error"]["type"] == "server_error" and text.endswith("data: [DONE]\n\n")


async def test_a_replica_param_with_list_indexes_is_written_as_the_routers_own():
    """README: vLLM's ``body.messages.0.content`` comes back as ``messages[0].content``, the form the
    router's own errors use (``messages[0].role`` below)."""
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    async with fake_replica() as replica, edge_router(replica) as (url, _):
        for sent, param in (("body.messages.0.content", "messages[0].content"),
                            ("body.messages.0.content.1.text", "messages[0].content[1].text"),
                            ("body.seed", "seed")):
            status, answer = await post(url, "/v1/chat/completions", json={**chat, "x_replica_param": sent})
            assert (status, answer["error"]["param"]) == (400, param), answer
        status, answer = await post(url, "/v1/chat/completions", json={"messages": [{"content": "hi"}]})
        assert (status, answer["error"]["param"]) == (400, "messages[0].role"), answer


async def test_a_client_may_not_set_the_replica_plugins_vllm_xargs():
    from replicas.vllm_plugin.contract import DETOKENIZE_KEY, SCORE_START_KEY
    from replicas.vllm_plugin.testing_hooks import SKIP_CAP_KEY
    from router.parse import PLUGIN_XARGS_PREFIX

    assert all(k.startswith(PLUGIN_XARGS_PREFIX) for k in (SCORE_START_KEY, DETOKENIZE_KEY, SKIP_CAP_KEY))
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    async with fake_replica() as replica, edge_router(replica) as (url, _):
        for path, body in (("/v1/completions", {"prompt": [5, 6]}), ("/v1/chat/completions", chat)):
            for key, value in ((SCORE_START_KEY, 0), (DETOKENIZE_KEY, False), (SKIP_CAP_KEY, True)):
                status, answer = await post(url, path, json={**body, "vllm_xargs": {"other": 1, key: value}})
                assert (status, answer["error"]["param"]) == (400, f"vllm_xargs.{key}"), answer
                assert answer["error"]["type"] == "invalid_request_error"
        assert replica.bodies == []
        status, _ = await post(url, "/v1/completions", json={"prompt": [5, 6], "vllm_xargs": {"other": 1}})
        assert status == 200 and replica.bodies[-1]["vllm_xargs"] == {"other": 1}  # other keys pass through


async def test_malformed_chunked_framing_is_a_4xx_and_the_router_goes_on(caplog):
    """aiohttp's parser answers framing errors itself (README "The edge"): a plain-text 400 when the
    bad chunk comes with the headers (no handler or middleware runs), and the router's 408 after
    ``body_timeout_s`` when it comes later (aiohttp never fails the body being read). Never a 5xx.
    Each refusal is one DEBUG line in the log, not an ERROR with a traceback (a client could
    otherwise fill the log)."""
    import logging

    caplog.set_level(logging.DEBUG, logger="aiohttp.server")
    from urllib.parse import urlsplit

    from tests.router.test_edge import raw_http, status_and_body

    async with fake_replica() as replica, edge_router(replica, body_timeout_s=0.5) as (url, _):
        parts = urlsplit(url)
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: " + parts.netloc.encode()
                + b"\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        answer = await raw_http(url, head + b"zz\r\n{}\r\n0\r\n\r\n")
        assert answer.split()[1] == b"400" and b"chunk size" in answer, answer
        refused = [r for r in caplog.records if r.name == "aiohttp.server"]
        assert [(r.levelno, r.exc_info) for r in refused] == [(logging.DEBUG, None)], refused
        assert "refused a malformed request" in refused[0].getMessage()

        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        try:
            writer.write(head)
            await writer.drain()
            await asyncio.sleep(0.1)  # the handler is reading the body when the bad chunk comes
            writer.write(b"zz\r\n{}\r\n0\r\n\r\n")
            got = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            length = next(int(line.split(b":")[1]) for line in got.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            status, body = status_and_body(got + await asyncio.wait_for(reader.readexactly(length), 10))
        finally:
            writer.close()
        assert (status, body["error"]["param"], body["error"]["type"]) == (408, "body", "invalid_request_error")
        assert (await post(url, "/v1/completions", json={"prompt": [5, 6]}))[0] == 200
        assert len(replica.bodies) == 1  # only the well-formed request reached the replica


@pytest.mark.parametrize("aborts", [1, 3])
async def test_an_answer_its_engine_aborted_part_way_is_run_again_whole_not_returned(aborts):
    """A replica paused with ``mode=abort`` (a weight update run by this router or another) ends
    running work with ``finish_reason: "abort"`` and the tokens so far: a 200 that is partial.
    The router runs it again whole (``reruns`` says so) instead of returning it; a fresh attacker
    saw 14 such answers returned by the router that did not run the update."""
    async with fake_replica() as replica, edge_router(replica) as (url, _):
        status, body = await post(url, "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 1, "x_aborts": aborts})
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"
    assert body["rollout_router"]["reruns"] == aborts and len(replica.bodies) == aborts + 1


async def test_a_replica_that_aborts_everything_fails_the_request_after_a_few_runs():
    async with fake_replica() as replica, edge_router(replica) as (url, _):
        status, body = await post(url, "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 1, "x_aborts": 99})
    assert status in (502, 503) and "error" in body  # a failure, never a partial 200
    assert len(replica.bodies) == 4  # three runs again, then a retry elsewhere: no other replica
