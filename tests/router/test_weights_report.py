"""What answers say about versions (``router.weights.report``) and how a relayed stream carries it
(``router.proxy.relay_stream`` with a watch), over real HTTP on loopback, no vLLM."""

from __future__ import annotations

import json

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from aiohttp import web

from cache_policy.config import PolicyConfig
from cache_policy.core import DecisionCore, RequestSpec
from cache_policy.types import ReplicaId
from router.proxy import relay_stream
from router.weights.report import StreamWatch, chunk_tokens, next_span, span, version_note

A = ReplicaId("a")


def core(policy: str) -> DecisionCore:
    c = DecisionCore(PolicyConfig(), weight_update_policy=policy)
    c.add_replica(A, block_size=32, num_gpu_blocks=100)
    return c


def placed(c: DecisionCore, **spec):
    job = c.open(RequestSpec(list(range(100, 200)), **spec), 0.0)
    c.place(job, 0.0)
    return job


def test_a_kept_stream_under_keep_gets_a_hybrid_span_a_recomputed_one_does_not():
    first = span(0, [0], {})
    kept = next_span([first], {0: 17}, 1, recomputed=False)
    assert kept == {"weight_version": 1, "kv_versions": [0, 1], "hybrid": True, "from_token": {0: 17}}
    again = next_span([first], {0: 17}, 1, recomputed=True)
    assert (again["kv_versions"], again["hybrid"]) == ([1], False)


def test_version_note_of_a_keep_answer_narrowed_when_nothing_was_cached():
    c = core("keep")
    c.version_loaded(A, 1)
    c.finish_update(1, "keep")
    job = placed(c)
    assert version_note(c, job, None, cached=None)["hybrid"] is True  # the unsalted cache holds v0 and v1
    note = version_note(c, job, None, cached=0)
    assert (note["weight_version"], note["kv_versions"], note["hybrid"]) == (1, [1], False)
    stream = version_note(c, job, [span(0, [0], {}), next_span([span(0, [0], {})], {0: 5}, 1, False)], cached=3)
    assert (stream["weight_versions"], stream["kv_versions"], stream["hybrid"]) == ([0, 1], [0, 1], True)


@pytest.mark.parametrize("choice,n", [
    ({"text": "ab", "token_ids": [5, 6]}, 2), ({"text": "a"}, 1), ({"text": ""}, 0),
    ({"delta": {"content": "x"}}, 1), ({"delta": {"role": "assistant", "content": ""}}, 0),
    ({"delta": {"content": "xy"}, "logprobs": {"content": [{}, {}]}}, 2),
    ({"text": "xy", "logprobs": {"tokens": ["x", "y"]}}, 2),
])
def test_chunk_tokens(choice, n):
    assert chunk_tokens(choice) == n


def sse(events: list) -> bytes:
    out = b""
    for e in events:
        out += b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n"
    return out


CHUNKS = [{"id": "c1", "object": "text_completion", "choices": [{"index": 0, "text": "a", "token_ids": [1]}]},
          {"id": "c1", "object": "text_completion", "choices": [{"index": 0, "text": "b", "token_ids": [2]}]},
          {"id": "c1", "object": "text_completion",
           "choices": [{"index": 0, "text": "c", "token_ids": [3], "finish_reason": "length"}]},
          {"id": "c1", "object": "text_completion", "choices": [],
           "usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 0}}}]


@pytest.mark.parametrize("events", [CHUNKS, CHUNKS[:2]])
async def test_the_final_chunk_before_done_carries_the_versions(events):
    body = sse(events + [b"[DONE]"])

    async def upstream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(0, len(body), 7):  # events split across writes
            await resp.write(body[i:i + 7])
        await resp.write_eof()
        return resp

    tokens: dict[int, int] = {}
    seen_cached = []

    def note(cached):
        seen_cached.append(cached)
        return {"weight_versions": [0], "tokens": dict(tokens)}

    target: dict = {}

    async def relay(request: web.Request) -> web.StreamResponse:
        return await relay_stream(request, target["http"], target["up"], {}, {}, StreamWatch(tokens, note))

    up = web.Application()
    up.router.add_post("/", upstream)
    front = web.Application()
    front.router.add_post("/", relay)
    runners = [web.AppRunner(a) for a in (up, front)]
    for r in runners:
        await r.setup()
    sites = [web.TCPSite(r, "127.0.0.1", 0) for r in runners]
    for s in sites:
        await s.start()
    ports = [s._server.sockets[0].getsockname()[1] for s in sites]
    try:
        async with aiohttp.ClientSession() as http:
            target.update(http=http, up=f"http://127.0.0.1:{ports[0]}/")
            async with http.post(f"http://127.0.0.1:{ports[1]}/") as r:
                raw = await r.read()
    finally:
        for r in runners:
            await r.cleanup()
    out = [e[6:] for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
    assert out[-1] == b"[DONE]"
    final = json.loads(out[-2])
    assert final["rollout_router"] == {"weight_versions": [0], "tokens": {"0": len([e for e in events if e["choices"]])}}
    decoded = [json.loads(e) for e in out[:-1]]
    assert [{k: v for k, v in d.items() if k != "rollout_router"} for d in decoded][:len(events)] == events
    assert len(decoded) == len(events) + (0 if events[-1].get("usage") else 1)  # own chunk when nothing was held
    assert seen_cached == ([0] if events[-1].get("usage") else [None])


def test_spans_without_tokens_are_dropped():
    first, later = span(0, [0], {}), span(1, [0, 1], {0: 4})
    assert [s["weight_version"] for s in version_note(core("keep"), placed(core("keep")), [first, later], None,
                                                      tokens={0: 4})["spans"]] == [0]  # ended before the update
    assert [s["weight_version"] for s in version_note(core("keep"), placed(core("keep")), [span(0, [0], {}),
                                                      span(1, [1], {})], None, tokens={0: 9})["spans"]] == [1]
    both = version_note(core("keep"), placed(core("keep")), [first, later], None, tokens={0: 9})
    assert both["weight_versions"] == [0, 1] and both["hybrid"]


@settings(max_examples=200, deadline=None)
@given(st.none() | st.integers(0, 5), st.lists(st.integers(0, 5), max_size=3), st.dictionaries(st.integers(0, 3), st.integers(0, 9), max_size=2),
       st.none() | st.integers(0, 3), st.integers(0, 2), st.none() | st.just({0: 4}), st.none() | st.integers(0, 5))
def test_a_one_span_note_is_the_general_rules(version, kv, from_token, cached, reruns, tokens, requested):
    """``version_note``'s one-span shortcut gives what its general rule gives (and leaves the flight's span alone)."""
    from router.weights.report import _note_of
    job = placed(core("keep"), weight_version=requested)
    spans = [span(version, kv, from_token)]
    before = json.dumps(spans)
    assert version_note(None, job, spans, cached, reruns, tokens) == _note_of(job, spans, cached, reruns, tokens)
    assert json.dumps(spans) == before
