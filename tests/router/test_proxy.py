"""The upstream client against raw loopback servers that misbehave (no vLLM needed).

A dropped keep-alive connection is retried once on a fresh one before the replica counts as
failing; a refused connection says so; a stream its replica breaks ends with an error event
and ``[DONE]``, never a silent truncation.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from replicas.auth import PROCESS_KEYS
from router.errors import UpstreamError
from router.errors import error_body
from router.proxy import FAILED, STREAM_ERROR_CODE, post_json, relay_stream
from router.weights.report import StreamWatch
from router.upstream import ReplicaClient, ReplicaUnreachable

pytestmark = pytest.mark.asyncio(loop_scope="function")
OK = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{"ok": true}'[:-1]


async def _server(handler):
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def _client(**kw) -> ReplicaClient:
    kw.setdefault("timeout_s", 10)
    return ReplicaClient(**kw)


async def _read_request(reader) -> tuple[bytes, dict[str, str], bytes]:
    """One HTTP/1.1 request off ``reader``: request line, headers (lower-case names), body."""
    head = await reader.readuntil(b"\r\n\r\n")
    line, *fields = head.decode().split("\r\n")[:-2]
    headers = {k.strip().lower(): v.strip() for k, _, v in (f.partition(":") for f in fields)}
    body = await reader.readexactly(int(headers.get("content-length", 0)))
    return line.encode(), headers, body


async def test_a_dropped_connection_is_retried_once_on_a_fresh_one():
    seen = []

    async def handle(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        seen.append(1)
        if len(seen) > 1:
            writer.write(b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}')
            await writer.drain()
        writer.close()  # the first request: closed without an answer, as a stale keep-alive is

    server, url = await _server(handle)
    client = _client()
    async with server:
        result = await post_json(client, url + "/v1/completions", {"prompt": [1]})
    await client.close()
    assert result.status == 200 and result.payload == {} and len(seen) == 2


async def test_two_drops_in_a_row_and_a_refused_connection_are_unreachable():
    async def handle(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.close()

    server, url = await _server(handle)
    client = _client()
    async with server:
        with pytest.raises(ReplicaUnreachable) as err:
            await post_json(client, url + "/x", {})
        assert not err.value.refused
    with pytest.raises(ReplicaUnreachable) as err:  # the server is closed now: nobody listens
        await post_json(client, url + "/x", {})
    assert err.value.refused
    await client.close()


async def test_requests_reuse_one_keep_alive_connection_and_carry_the_body_and_replica_key():
    connections, requests = [], []

    async def handle(reader, writer):
        connections.append(1)
        try:
            while True:
                line, headers, body = await _read_request(reader)
                requests.append((line, headers, json.loads(body)))
                answer = json.dumps({"n": len(requests)}).encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                             + str(len(answer)).encode() + b"\r\n\r\n" + answer)
                await writer.drain()
        except asyncio.IncompleteReadError:
            writer.close()

    server, url = await _server(handle)
    PROCESS_KEYS.set_key(url, "k-123")
    client = _client()
    try:
        async with server:
            for i in range(5):
                result = await post_json(client, url + "/v1/completions?x=1", {"prompt": [i, 2 ** 31]})
                assert result.status == 200 and result.payload == {"n": i + 1}
            assert client.idle_connections() == 1
    finally:
        PROCESS_KEYS.set_key(url, None)
        await client.close()
    assert len(connections) == 1 and len(requests) == 5
    line, headers, body = requests[-1]
    assert line == b"POST /v1/completions?x=1 HTTP/1.1" and body == {"prompt": [4, 2 ** 31]}
    assert headers["authorization"] == "Bearer k-123" and headers["content-type"] == "application/json"
    assert headers["host"] == url.removeprefix("http://")


async def test_a_chunked_answer_is_read_whole_and_connection_close_is_not_pooled():
    async def handle(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
                     b"Connection: close\r\n\r\n4\r\n{\"a\"\r\n3\r\n: 1\r\n1\r\n}\r\n0\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.close()

    server, url = await _server(handle)
    client = _client()
    async with server:
        result = await post_json(client, url + "/x", {})
    assert result.status == 201 and result.payload == {"a": 1} and client.idle_connections() == 0
    await client.close()


@pytest.mark.parametrize("split", [False, True])
async def test_an_informational_answer_is_skipped_for_the_final_one(split):
    """A replica's ``100 Continue`` / ``103 Early Hints`` before its answer was taken as the answer
    (a body-less 100 relayed to the client, which then hung; a fresh attacker's replica); the
    final answer is the one read, in one write or in pieces, and the connection stays usable."""
    seen = []

    async def handle(reader, writer):
        while True:
            try:
                await _read_request(reader)
            except asyncio.IncompleteReadError:
                break
            seen.append(1)
            parts = [b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n",
                     b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 12\r\n\r\n{\"ok\": true}"]
            for part in parts if split else [b"".join(parts)]:
                writer.write(part)
                await writer.drain()
                await asyncio.sleep(0.01)
        writer.close()

    server, url = await _server(handle)
    client = _client()
    async with server:
        for _ in range(2):
            result = await post_json(client, url + "/v1/completions", {"prompt": [1]})
            assert (result.status, result.payload) == (200, {"ok": True})
        assert client.idle_connections() == 1 and len(seen) == 2  # one connection kept for both
    await client.close()


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"half\":",  # cut short
    b"SSH-2.0-OpenSSH\r\n\r\n",  # not HTTP at all
])
async def test_an_answer_cut_short_or_not_http_is_unreachable_and_never_sent_again(answer):
    seen = []

    async def handle(reader, writer):
        await _read_request(reader)
        seen.append(1)
        writer.write(answer)
        await writer.drain()
        writer.close()

    server, url = await _server(handle)
    client = _client()
    async with server:
        with pytest.raises(ReplicaUnreachable) as err:
            await post_json(client, url + "/x", {})
    await client.close()
    assert not err.value.refused and len(seen) == 1  # a replica that started answering ran it: no retry


@pytest.mark.parametrize("how", ["timeout", "cancel"])
async def test_a_request_timed_out_or_cancelled_closes_its_connection(how):
    # vLLM aborts a request whose connection closes: a timed-out or abandoned request frees its KV cache
    closed = asyncio.Event()

    async def handle(reader, writer):
        await _read_request(reader)
        if await reader.read(1) == b"":  # never answers; EOF: the router dropped the connection
            closed.set()
        writer.close()

    server, url = await _server(handle)
    client = _client(timeout_s=0.3)
    async with server:
        if how == "timeout":
            with pytest.raises(UpstreamError, match="timed out"):
                await post_json(client, url + "/x", {})
        else:
            task = asyncio.ensure_future(post_json(client, url + "/x", {}))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        await asyncio.wait_for(closed.wait(), 5)
    assert client.idle_connections() == 0
    await client.close()


async def test_a_connection_idle_past_idle_s_is_not_reused():
    connections = []

    async def handle(reader, writer):
        connections.append(1)
        try:
            while True:
                await _read_request(reader)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
                await writer.drain()
        except asyncio.IncompleteReadError:
            writer.close()

    server, url = await _server(handle)
    client = _client(idle_s=0.2)
    async with server:
        await post_json(client, url + "/x", {})
        await post_json(client, url + "/x", {})
        await asyncio.sleep(0.3)
        await post_json(client, url + "/x", {})
    await client.close()
    assert len(connections) == 2


async def test_concurrent_requests_to_an_aiohttp_server_each_get_their_own_answer():
    async def echo(request: web.Request) -> web.Response:
        body = await request.json()
        await asyncio.sleep(0.01 * (body["i"] % 3))
        return web.json_response({"i": body["i"]})

    app = web.Application()
    app.router.add_post("/v1/completions", echo)
    async with TestServer(app, host="127.0.0.1") as server:
        client = _client()
        url = str(server.make_url("/v1/completions"))
        for _ in range(3):
            results = await asyncio.gather(*(post_json(client, url, {"i": i}) for i in range(40)))
            assert [r.payload["i"] for r in results] == list(range(40))
        assert 1 <= client.idle_connections() <= 40
        await client.close()
    with pytest.raises(ReplicaUnreachable):
        await post_json(client, url, {"i": 0})  # closed


async def _one_token_stream(reader, writer) -> None:
    """Read a request, answer the head of an event stream and its first token's event."""
    await reader.readuntil(b"\r\n\r\n")
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
    event = b'data: {"choices": [{"text": "a"}]}\n\n'
    writer.write(b"%x\r\n%s\r\n" % (len(event), event))
    await writer.drain()


async def test_a_stream_its_replica_breaks_ends_with_an_error_event_and_done():
    async def handle(reader, writer):
        await _one_token_stream(reader, writer)
        writer.close()  # dies mid-stream: no terminating chunk

    events = await _failed_stream_events(handle, StreamWatch({}, lambda cached: {}))
    assert json.loads(events[0])["choices"][0]["text"] == "a"
    assert json.loads(events[1])["error"]["code"] == STREAM_ERROR_CODE and events[2] == "[DONE]"


async def _failed_stream_events(handle, watch: StreamWatch) -> list[str]:
    """The ``data:`` payloads a client gets from ``relay_stream`` over a replica served by
    ``handle``, which must end it as failed (``FAILED``)."""
    server, url = await _server(handle)
    async with server, aiohttp.ClientSession() as upstream:
        async def relay(request: web.Request) -> web.StreamResponse:
            resp = await relay_stream(request, upstream, url + "/v1/completions", {"stream": True}, {}, watch)
            assert resp[FAILED] == "failed"
            return resp

        app = web.Application()
        app.router.add_post("/relay", relay)
        async with TestClient(TestServer(app)) as client:
            r = await client.post("/relay", json={})
            text = await r.text()
    return [line[6:] for line in text.split("\n") if line.startswith("data: ")]


async def test_a_stream_its_replica_ends_with_its_own_error_event_gets_the_routers_error_event():
    # a fresh attacker: a stream whose engine core died mid-way ended with vLLM's own event
    # (type InternalServerError, code 500, nothing of "retry"), unlike every other broken stream
    async def handle(reader, writer):
        await _one_token_stream(reader, writer)
        for event in (b'data: {"error": {"message": "EngineCore encountered an issue.", "type": '
                      b'"InternalServerError", "param": null, "code": 500}}\n\n', b"data: [DONE]\n\n"):
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    events = await _failed_stream_events(handle, StreamWatch({}, lambda cached: {"weight_versions": [3]}))
    assert len(events) == 3 and json.loads(events[0])["choices"][0]["text"] == "a" and events[2] == "[DONE]", events
    error = json.loads(events[1])
    assert error["error"] == error_body(STREAM_ERROR_CODE, "the replica ended the stream with an error: EngineCore "
                                                           "encountered an issue.; retry the request")["error"], error
    assert error["rollout_router"] == {"weight_versions": [3]}


async def test_a_stream_ended_from_outside_says_why_and_ends_with_done():
    # Lifecycle.left_paused: a replica a failed update left paused sends no token more; its
    # streams are ended through their StreamWatch, the reason in the error event
    relayed = asyncio.Event()

    async def handle(reader, writer):
        await _one_token_stream(reader, writer)
        await asyncio.sleep(30)  # paused: nothing more comes

    server, url = await _server(handle)
    watch = StreamWatch({}, lambda cached: {"weight_versions": [7], "cached": cached})
    async with server, aiohttp.ClientSession() as upstream:
        async def relay(request: web.Request) -> web.StreamResponse:
            resp = await relay_stream(request, upstream, url + "/v1/completions", {"stream": True}, {}, watch,
                                      start=lambda aborted: relayed.set())
            assert resp[FAILED] == "ended"
            return resp

        app = web.Application()
        app.router.add_post("/relay", relay)
        async with TestClient(TestServer(app)) as client:
            answer = asyncio.ensure_future(client.post("/relay", json={}))
            await asyncio.wait_for(relayed.wait(), 10)
            await asyncio.sleep(0.05)
            assert watch.end("replica r was left paused") and not watch.end("again")
            r = await asyncio.wait_for(answer, 10)
            text = await r.text()
    events = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["text"] == "a" and events[2] == "[DONE]", events
    error = json.loads(events[1])["error"]
    assert error["code"] == STREAM_ERROR_CODE and error["message"] == "replica r was left paused; retry the request"
    # the versions of the token it did get: a client keeping the partial answer can tell
    assert json.loads(events[1])["rollout_router"] == {"weight_versions": [7], "cached": None}
    assert watch.tokens == {0: 1} and watch.ended == "replica r was left paused"
