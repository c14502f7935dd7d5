"""POST /v1/score: OPD teacher scoring of K responses to one context (seed 000).

Request (JSON):

    {"context": [token ids] | "text",  or  "messages": [chat messages],
     "responses": [[token ids], ...],            # K >= 1 responses, each >= 1 token
     "top_logprobs": 0,                          # extra top-k alternatives per row (0..20)
     "weight_version": 3, "session_id": "...", "model": "..."}   # optional

Response (200 only when every response is complete):

    {"replica": "replica-0", "context_tokens": P, "score_start": S = P - 1,
     "scoring_cap": true,                        # false: the replica recomputed (cache reads off)
     "results": [{"index": k, "token_ids": [...], "logprobs": [R_k floats],
                  "top_logprobs": [[{"token_id": t, "logprob": x}, ...] per row] (if asked),
                  "prompt_tokens": N_k, "cached_tokens": c_k}, ...]}

The router computes P and S, routes by the context's block hashes (so the replica holding the
context is preferred), and sends the K requests concurrently as ``prompt_logprobs`` completions.
To a replica whose plugin reports an active cap it forwards S in ``vllm_xargs``; the plugin
caps the cache hit at ``min(S, N - 1)``. To any other replica it sends the same requests
without S: vLLM then skips cache reads (correct, slower), and the response says so.
A failure is retried whole on another replica (``router.connect_retries`` times); nothing partial
is returned. The K requests are one job of the request lifecycle (``router.lifecycle``): they
count K against the replica's load, the pins and admission alike. The answer is written to the
client before the job is released (``router.responses.send_now``), as completions are.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from cache_policy.scoring import ScoringCap, scoring_cap
from cache_policy.core import Job, RequestSpec
from replicas.replica_set import ReplicaEndpoint
from replicas.vllm_plugin.contract import DETOKENIZE_KEY, SCORE_START_KEY
from router import keys
from router.errors import RouterError, UpstreamError, router_param
from router.lifecycle import RetryElsewhere
from router.intake import read_score
from router.parse import ScoreRequest, parse_score
from router.proxy import cached_tokens_of, post_json
from router.upstream import ReplicaClient
from router.responses import annotation, route_headers, send_now

__all__ = ["ScoreRequest", "parse_score", "score"]  # parse_score lives in router.parse since the typed schemas


def _rows(payload: dict[str, Any], context_len: int, response: list[int], top: int) -> dict[str, Any]:
    """Pick response rows P..N-1 out of vLLM's ``prompt_logprobs``; UpstreamError if any is missing."""
    choice = payload["choices"][0]
    table = choice.get("prompt_logprobs") or []
    n = context_len + len(response)
    if len(table) != n:
        raise UpstreamError(f"replica returned {len(table)} prompt-logprob rows for {n} prompt tokens")
    logprobs, alternatives = [], []
    for i, token in enumerate(response):
        row = table[context_len + i]
        entry = row.get(str(token)) if isinstance(row, dict) else None
        value = entry.get("logprob") if isinstance(entry, dict) else None
        if not isinstance(value, (int, float)) or value != value:  # missing or NaN: never computed
            raise UpstreamError(f"replica returned an incomplete score: row {context_len + i} is missing")
        logprobs.append(float(value))
        if top:
            ranked = sorted(((int(t), e) for t, e in row.items() if isinstance(e, dict) and e.get("rank")
                             and e["rank"] <= top), key=lambda te: te[1]["rank"])
            alternatives.append([{"token_id": t, "logprob": e["logprob"]} for t, e in ranked])
    usage = payload.get("usage")
    usage = usage if isinstance(usage, dict) else {}
    cached = cached_tokens_of(usage)
    prompt = usage.get("prompt_tokens")
    out = {"token_ids": response, "logprobs": logprobs,
           "prompt_tokens": prompt if isinstance(prompt, int) and not isinstance(prompt, bool) else n,
           "cached_tokens": cached or 0}
    if top:
        out["top_logprobs"] = alternatives
    return out


async def _score_one(client: ReplicaClient, endpoint: ReplicaEndpoint, job: Job, req: ScoreRequest, context: list[int],
                     cap: ScoringCap, response: list[int]) -> dict[str, Any]:
    body: dict[str, Any] = {"model": req.model or endpoint.model, "prompt": context + response,
                            "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": req.top_logprobs}
    body["vllm_xargs"] = {DETOKENIZE_KEY: False}  # we read rows by token id; ignored without the plugin
    if endpoint.scoring_cap:
        body["vllm_xargs"][SCORE_START_KEY] = cap.start
    if job.salt is not None:
        body["cache_salt"] = job.salt
    result = await post_json(client, endpoint.base_url + "/v1/completions", body)
    if 400 <= result.status < 500 and not result.replica_failed():
        raise _replica_rejection(result)
    if result.status != 200 or not isinstance(result.payload, dict):
        raise RetryElsewhere(f"replica {endpoint.replica_id} failed a scoring request with HTTP {result.status}")
    try:
        return _rows(result.payload, len(context), response, req.top_logprobs)
    except UpstreamError as exc:  # an incomplete score is never returned: run it whole elsewhere
        raise RetryElsewhere(str(exc)) from exc


def _replica_rejection(result) -> RouterError:
    """A replica's 4xx as our error: its status, and its ``param`` when it names one."""
    error = result.payload.get("error", {}) if isinstance(result.payload, dict) else {}
    message = error.get("message") or result.raw[:200].decode("utf-8", "replace")
    exc = RouterError(f"replica rejected the scoring request: {message}",
                      param=router_param(error.get("param"), "score") or "responses")
    exc.status = result.status  # its type follows (router.errors.error_type)
    return exc


async def _gather_or_cancel(coros) -> list[Any]:
    """All results, or the first exception with every sibling cancelled (no orphan requests)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def score(request: web.Request) -> web.Response:
    """POST /v1/score handler: one job of K engine requests through the request lifecycle."""
    req, context = await read_score(request)  # validated, tokenized, checked against max_model_len
    app = request.app
    caps = [scoring_cap(len(context), len(context) + len(r)) for r in req.responses]
    life, core, metrics = app[keys.LIFECYCLE], app[keys.CORE], app[keys.METRICS]
    k = req.keys
    spec = RequestSpec(context, k.session_id, k.group_id, k.weight_version, k.tenant, "score",
                       new_tokens=sum(len(r) + 1 for r in req.responses), fan_out=len(req.responses))

    expose = getattr(app[keys.CONFIG].router, "expose_expected_cached_tokens", True)

    async def attempt(job: Job, endpoint: ReplicaEndpoint) -> web.Response:
        rows = await _gather_or_cancel(_score_one(life.upstream, endpoint, job, req, context, cap, r)
                                       for cap, r in zip(caps, req.responses))
        life.answer_starts(job)  # every row from one version's weights over its own KV, or run it again
        flight = life.flight(job)
        note = annotation(job, core, expose_cached=expose, spans=flight.spans if flight else None,
                          reruns=life.reruns.get(job.id, 0))
        resp = web.json_response({
            "replica": job.replica_id, "context_tokens": len(context), "score_start": caps[0].start,
            "scoring_cap": endpoint.scoring_cap,
            **{f: note[f] for f in ("cache_salt", "weight_version", "weight_versions", "kv_versions", "hybrid",
                                    "reruns", "requested_weight_version")},
            "results": [{"index": i, **r} for i, r in enumerate(rows)],
        }, headers=route_headers(job, expose_cached=expose))
        await send_now(request, resp)  # before the lifecycle releases the job, as completions do
        metrics.count_prompt(job, sum(len(context) + len(r) for r in req.responses),
                             sum(row["cached_tokens"] for row in rows))
        return resp

    return await life.run(spec, attempt, status=lambda r: r.status)
