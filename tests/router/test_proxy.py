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

from router.proxy import FAILED, STREAM_ERROR_CODE, ReplicaUnreachable, post_json, relay_stream

pytestmark = pytest.mark.asyncio(loop_scope="function")
OK = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{"ok": true}'[:-1]


async def _server(handler):
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


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
    async with server, aiohttp.ClientSession() as http:
        result = await post_json(http, url + "/v1/completions", {"prompt": [1]})
    assert result.status == 200 and result.payload == {} and len(seen) == 2


async def test_two_drops_in_a_row_and_a_refused_connection_are_unreachable():
    async def handle(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.close()

    server, url = await _server(handle)
    async with server, aiohttp.ClientSession() as http:
        with pytest.raises(ReplicaUnreachable) as err:
            await post_json(http, url + "/x", {})
        assert not err.value.refused
    async with aiohttp.ClientSession() as http:  # the server is closed now: nobody listens
        with pytest.raises(ReplicaUnreachable) as err:
            await post_json(http, url + "/x", {})
        assert err.value.refused


async def test_a_stream_its_replica_breaks_ends_with_an_error_event_and_done():
    async def handle(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        event = b'data: {"choices": [{"text": "a"}]}\n\n'
        writer.write(b"%x\r\n%s\r\n" % (len(event), event))
        await writer.drain()
        writer.close()  # dies mid-stream: no terminating chunk

    server, url = await _server(handle)
    async with server, aiohttp.ClientSession() as upstream:
        async def relay(request: web.Request) -> web.StreamResponse:
            resp = await relay_stream(request, upstream, url + "/v1/completions", {"stream": True}, {})
            assert resp[FAILED] is True
            return resp

        app = web.Application()
        app.router.add_post("/relay", relay)
        async with TestClient(TestServer(app)) as client:
            r = await client.post("/relay", json={})
            text = await r.text()
    events = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["text"] == "a"
    assert json.loads(events[1])["error"]["code"] == STREAM_ERROR_CODE and events[2] == "[DONE]"
