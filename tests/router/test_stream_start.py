"""A stream is a request like any other until its first token reaches the client: nothing (not
even its head) goes before it, so until then the router can still run it again whole.

Real routers over real HTTP on loopback, in front of fake vLLM servers whose streams run as
vLLM's do (``tests.router.fake_vllm``: the head at once, the request in the engine later, each
token naming the weights that made it). A fresh attacker found both of the first two cases on
real vLLM: under ``pause_mode: abort`` a stream sent just before the pause was not yet in the
engine, so the abort missed it, and it ran on the new weights while claiming the old version;
and a stream aborted before its first token ended as an empty 200.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import time
import contextlib
import json
from typing import Any

import aiohttp
import pytest

from router import keys
from tests.router.fake_vllm import FakeVllm, serving
from tests.router.test_fleet_changes import ADMIN, router, until

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPT = list(range(10, 74))


async def stream(url: str, max_tokens: int) -> tuple[int, list[dict[str, Any]]]:
    """POST a streamed completion; its status and its ``data:`` events (``[DONE]`` as a string)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        body = {"prompt": PROMPT, "max_tokens": max_tokens, "stream": True}
        async with http.post(url + "/v1/completions", json=body) as r:
            raw = await r.read()
            status = r.status
    events = [e[6:] for e in raw.decode().split("\n\n") if e.startswith("data: ")]
    return status, [e if e == "[DONE]" else json.loads(e) for e in events]


def texts(events: list) -> list[str]:
    return [c["text"] for e in events if isinstance(e, dict) for c in e.get("choices", []) if c.get("text")]


def note(events: list) -> dict[str, Any]:
    """The ``rollout_router`` object of the chunk before ``[DONE]``."""
    assert events[-1] == "[DONE]", events
    return events[-2]["rollout_router"]


async def test_a_stream_not_yet_in_the_engine_at_an_abort_pause_runs_again_on_the_new_weights():
    fake = FakeVllm()
    fake.enter_delay_s, fake.token_delay_s = 1.0, 0.02  # the pause comes before it reaches the engine
    async with serving(fake) as base, router([base]) as (url, _, _rs):
        client = asyncio.ensure_future(stream(url, max_tokens=4))
        await until(lambda: _true(len(fake.bodies) == 1), what="the stream sent")
        update = {"version": 1, "weights_path": "1", "policy": "keep", "pause_mode": "abort"}
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/admin/weights", json=update, headers=ADMIN) as r:
                report = await r.json()
        status, events = await asyncio.wait_for(client, 30)
    assert report["ok"] and fake.pauses == ["abort"], report
    assert status == 200 and texts(events) == [" w1"] * 4, events  # every token from the new weights
    claim = note(events)
    assert (claim["weight_version"], claim["weight_versions"], claim["reruns"]) == (1, [1], 1), claim
    assert len(fake.bodies) == 2  # taken back before its pause, sent again after it


async def test_a_stream_aborted_before_its_first_token_runs_again_instead_of_an_empty_answer():
    fake = FakeVllm()
    fake.token_delay_s = 0.5
    async with serving(fake) as base, router([base]) as (url, _, _rs):
        client = asyncio.ensure_future(stream(url, max_tokens=2))
        await until(lambda: _true(len(fake._streams) == 1), what="the stream in the engine")
        async with aiohttp.ClientSession() as http:  # another router's update pauses it (abort), resumes
            for path in ("/pause?mode=abort", "/resume"):
                async with http.post(base + path) as r:
                    assert r.status == 200
        status, events = await asyncio.wait_for(client, 30)
    assert status == 200 and texts(events) == [" w0", " w0"], events
    finishes = [c.get("finish_reason") for e in events if isinstance(e, dict) for c in e.get("choices", [])]
    assert "abort" not in finishes and finishes[-1] == "length", events
    assert note(events)["reruns"] == 1 and len(fake.bodies) == 2


@pytest.mark.parametrize("failure", ["break_streams", "error_streams"])
async def test_a_replica_that_fails_before_the_first_token_is_retried_elsewhere_unseen(failure):
    # its connection breaks, or it ends the stream with an error event (vLLM's engine failed)
    fake = FakeVllm()
    setattr(fake, failure, 1)
    async with contextlib.AsyncExitStack() as stack:
        bases = [await stack.enter_async_context(serving(fake)) for _ in range(2)]  # two replicas, one server
        url, app, _rs = await stack.enter_async_context(router(bases))
        status, events = await asyncio.wait_for(stream(url, max_tokens=2), 30)
    assert status == 200 and texts(events) == [" w0", " w0"], events  # no error event: the client saw nothing
    assert not [e for e in events if isinstance(e, dict) and "error" in e], events
    assert len(fake.bodies) == 2


async def _true(value: bool) -> bool:
    return value


async def test_a_client_that_leaves_before_the_first_token_leaves_nothing_behind():
    fake = FakeVllm()
    fake.token_delay_s = 3.0  # a long prefill: nothing has gone to the client when it leaves
    async with serving(fake) as base, router([base]) as (url, app, _rs):
        life, core = app[keys.LIFECYCLE], app[keys.CORE]
        with pytest.raises(asyncio.TimeoutError):
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.5)) as http:
                body = {"prompt": PROMPT, "max_tokens": 2, "stream": True}
                async with http.post(url + "/v1/completions", json=body) as r:
                    await r.read()
        await until(lambda: _true(not fake._streams), what="the engine's request aborted (its connection closed)")
        await until(lambda: _true(life.state_sizes() == {"flights": 0, "waiters": 0, "reruns": 0}
                                  and core.in_flight("replica-0") == 0), what="the router's state empty")
    assert len(fake.bodies) == 1  # not run again: the client is gone


async def test_a_stream_whose_engine_stalls_before_its_first_token_runs_on_another_replica():
    # vLLM sends a stream's head at once; an engine hung behind its live API server then sends
    # nothing more. The router has sent the client nothing, so the stall rule takes the stream
    # back and runs it on the other replica (had the head gone on, it would wait for
    # router.request_timeout_s and end with an error event)
    fakes = [FakeVllm(), FakeVllm()]
    async with serving(fakes[0]) as u0, serving(fakes[1]) as u1, \
            router([u0, u1], scrape_interval_s=0.2) as (url, app, _rs):
        app[keys.CORE].cfg = dataclasses.replace(app[keys.CORE].cfg, stall_timeout_s=1.0)
        headers = {"X-Session-Id": "stalled-stream"}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            body = {"prompt": PROMPT, "max_tokens": 2, "stream": True}
            async with http.post(url + "/v1/completions", json=body, headers=headers) as r:
                pinned = r.headers["X-Rollout-Replica"]
                await r.read()
            stalled = fakes[int(pinned.rsplit("-", 1)[1])]
            stalled.stall()
            t0 = time.monotonic()
            async with http.post(url + "/v1/completions", json=body, headers=headers) as r:
                replica, raw = r.headers["X-Rollout-Replica"], (await r.read()).decode()
            took = time.monotonic() - t0
            failures = app[keys.CORE].replicas[pinned].failures
        stalled.resume()
    assert replica != pinned and raw.count('" w0"') == 2 and '"error"' not in raw, raw
    assert 1.0 <= took < 15, took  # the stall timeout, not router.request_timeout_s
    assert failures == 0  # abandoned, not failed: the stall rule has it out already (no second count)


async def test_a_client_reading_a_finished_stream_slowly_never_makes_its_healthy_engine_stalled():
    # the engine has made every token (the router reads ahead of the client), the client reads
    # nothing: the request stays in flight, but it is answering, so it is not work the engine
    # holds; the stall rule must not take the replica out (a fresh attacker's slow reader got a
    # healthy replica restarted)
    fake = FakeVllm()
    fake.weights = "0" * 8000  # 8 KB tokens: 30 MB in all, more than the sockets between hold
    async with serving(fake) as base, router([base], scrape_interval_s=0.1) as (url, app, _rs):
        core = app[keys.CORE]
        core.cfg = dataclasses.replace(core.cfg, stall_timeout_s=0.5)
        host, port = url.removeprefix("http://").split(":")
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
        body = json.dumps({"prompt": PROMPT, "max_tokens": 4000, "stream": True}).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        await asyncio.get_running_loop().sock_sendall(sock, head + body)
        first = await asyncio.get_running_loop().sock_recv(sock, 1024)
        try:
            await until(lambda: _true(not fake._streams), what="the engine done with the stream")
            t0 = time.monotonic()
            while time.monotonic() - t0 < 2.0:  # four stall timeouts, the client reading nothing
                assert not core.stalled("replica-0", time.monotonic()) and core.replicas["replica-0"].healthy
                await asyncio.sleep(0.1)
            assert app[keys.LIFECYCLE].state_sizes()["flights"] == 1, first[:600]  # still in flight: the client has not read it
        finally:
            sock.close()
    assert first.startswith(b"HTTP/1.1 200")


async def test_a_stream_the_replica_refuses_in_an_error_event_is_a_400_naming_the_field_not_retried():
    # vLLM checks logprobs <= 20 inside its generator: a streamed request gets a 200 head, then
    # a 400 error event. Nothing reached the client: it gets the 400 naming the field, as the
    # same request unstreamed does, and no other replica is tried (a fresh user got a 502)
    fake = FakeVllm()
    async with contextlib.AsyncExitStack() as stack:
        bases = [await stack.enter_async_context(serving(fake)) for _ in range(2)]
        url, app, _rs = await stack.enter_async_context(router(bases))
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            body = {"prompt": PROMPT, "max_tokens": 2, "stream": True, "logprobs": 50}
            async with http.post(url + "/v1/completions", json=body) as r:
                status, error = r.status, (await r.json())["error"]
    assert len(fake.bodies) == 1  # not tried on the other replica
    assert status == 400 and error["param"] == "logprobs" and "greater than max allowed" in error["message"], error


async def test_a_stream_read_to_its_end_by_the_openai_sdk_is_a_200_even_when_the_sdk_closes_at_done():
    # a fresh new user: 5 of 7 streams the openai SDK read whole were counted 499 ("client left"):
    # the SDK closes its connection once it reads [DONE], while the router still waited for the
    # replica to end its response (vLLM's end may lag its [DONE]); the lifecycle saw a cancel too
    import openai

    fake = FakeVllm()
    fake.done_delay_s = 0.2
    async with serving(fake) as u0, router([u0]) as (url, app, _rs):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        for _ in range(4):
            chunks = [c async for c in await client.completions.create(
                model=fake.model, prompt=[5, 6, 7, 8], max_tokens=3, stream=True)]
            assert "".join(c.choices[0].text for c in chunks if c.choices) == " w0" * 3
            assert chunks[-1].model_extra["rollout_router"]["weight_version"] == 0  # the annotated last chunk
        await client.close()
        await asyncio.sleep(0.3)
        requests = app[keys.METRICS].requests
        counted = {s: requests.labels("completions", s)._value.get() for s in ("200", "499")}
    assert counted == {"200": 4, "499": 0}, counted


async def test_streams_whose_replica_ends_its_response_after_done_reuse_one_upstream_connection():
    # the relay stops at [DONE] (the SDK closes there); the replica's response end came a moment
    # later, unread, and releasing it closed the connection: every stream opened a new one
    fake = FakeVllm()
    fake.done_delay_s = 0.05
    async with serving(fake) as u0, router([u0]) as (url, app, _rs):
        async with aiohttp.ClientSession() as http:
            for _ in range(5):
                body = {"model": fake.model, "prompt": [5, 6, 7, 8], "max_tokens": 2, "stream": True}
                async with http.post(url + "/v1/completions", json=body) as r:
                    assert r.status == 200 and (await r.read()).endswith(b"data: [DONE]\n\n")
                await asyncio.sleep(0.2)  # its end arrived: the connection is back in the pool
    assert len(fake.bodies) == 5 and len(fake.connections) == 1, fake.connections
