"""POST /v1/score against real vLLM-CPU replicas: rows equal the uncached scores exactly."""

from __future__ import annotations

import dataclasses

import pytest

from router.config import AppConfig
from router.server import running_router
from tests.router.conftest import unique_prompt

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]
BLOCK = 32


async def _uncached_rows(router, base_url: str, context: list[int], response: list[int]) -> list[float]:
    """Independent truth: the replica scores context + response with cache reads off (no S)."""
    body = {"model": "tiny-llama", "prompt": context + response, "max_tokens": 1, "prompt_logprobs": 0}
    async with router.http.post(base_url + "/v1/completions", json=body) as r:
        payload = await r.json()
        assert r.status == 200, payload
    table = payload["choices"][0]["prompt_logprobs"]
    return [table[len(context) + i][str(t)]["logprob"] for i, t in enumerate(response)]


async def _score(http, url: str, body: dict) -> dict:
    async with http.post(url + "/v1/score", json=body) as r:
        payload = await r.json()
        assert r.status == 200, payload
        return payload


async def test_k4_scores_match_uncached_and_reuse_the_context(router, replica_set):
    context = unique_prompt(40, 2000)
    responses = [unique_prompt(41 + k, 40 + 30 * k) for k in range(4)]
    out = await _score(router.http, router.url, {"context": context, "responses": responses})
    assert out["context_tokens"] == 2000 and out["score_start"] == 1999
    base = replica_set.endpoint(out["replica"]).base_url
    for k, result in enumerate(out["results"]):
        assert result["index"] == k and result["token_ids"] == responses[k]
        # bit for bit: the replicas run chunk-invariant attention (ReplicaSetConfig default)
        assert result["logprobs"] == await _uncached_rows(router, base, context, responses[k])
    assert out["scoring_cap"] is True  # the replicas run the plugin
    cached = sorted(r["cached_tokens"] for r in out["results"])
    # the context is computed once; every hit is capped at S = 1999, rounded down to a block: 1984
    assert cached[-1] == (1999 // BLOCK) * BLOCK


async def test_fallback_without_cap_returns_exact_rows(router, replica_set):
    """A replica without an active cap gets the same requests with cache reads off."""
    endpoints = [dataclasses.replace(ep, scoring_cap=False) for ep in replica_set.endpoints]
    cfg = AppConfig().replace(router={"port": 0, "scrape_interval_s": 0})
    context, responses = unique_prompt(50, 700), [unique_prompt(51, 20), unique_prompt(52, 9)]
    async with running_router(cfg, endpoints) as (url, _):
        out = await _score(router.http, url, {"context": context, "responses": responses, "top_logprobs": 2})
    assert out["scoring_cap"] is False
    base = replica_set.endpoint(out["replica"]).base_url
    for k, result in enumerate(out["results"]):
        assert result["cached_tokens"] == 0
        assert result["logprobs"] == await _uncached_rows(router, base, context, responses[k])
        assert all(len(alts) == 2 for alts in result["top_logprobs"])


async def test_score_bad_input_is_400_naming_the_field(router):
    async with router.http.post(router.url + "/v1/score", json={"context": [1, 2], "responses": [[3], "x"]}) as r:
        assert r.status == 400 and (await r.json())["error"]["param"] == "responses[1]"
