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
A failure is retried once, whole, on another replica; nothing partial is returned.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from cache_policy.scoring import ScoringCap, scoring_cap
from replicas.vllm_plugin.contract import DETOKENIZE_KEY, SCORE_START_KEY
from router import keys
from router.admission import ReplicaGone
from router.dispatch import Placement
from router.errors import BadRequest, RouterError, UpstreamError, router_param
from router.parse import RoutingKeys, _is_token_ids, _routing_keys, _validate_messages, load_json_object
from router.proxy import ReplicaUnreachable, post_json

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class ScoreRequest:
    """A validated scoring request (context not yet tokenized if given as text/messages)."""

    context: str | list[int] | None
    messages: list[dict[str, Any]] | None
    responses: list[list[int]]
    top_logprobs: int
    keys: RoutingKeys
    model: str | None


def parse_score(body: dict[str, Any], headers) -> ScoreRequest:
    """Validate a /v1/score body; BadRequest naming the field."""
    routing = _routing_keys(body, headers)
    context, messages = body.get("context"), body.get("messages")
    if (context is None) == (messages is None):
        raise BadRequest("give exactly one of 'context' (token IDs or text) or 'messages'", param="context")
    if messages is not None:
        _validate_messages(messages)
    elif not ((isinstance(context, str) or _is_token_ids(context)) and context):
        raise BadRequest("'context' must be a non-empty string or list of token IDs", param="context")
    elif isinstance(context, list) and min(context) < 0:
        raise BadRequest("'context' token IDs must be >= 0", param="context")
    responses = body.get("responses")
    if not isinstance(responses, list) or not responses:
        raise BadRequest("'responses' must be a non-empty list of token-ID lists", param="responses")
    for k, r in enumerate(responses):
        if not _is_token_ids(r) or not r or min(r) < 0:
            raise BadRequest(f"'responses[{k}]' must be a non-empty list of token IDs >= 0",
                             param=f"responses[{k}]")
    top = body.get("top_logprobs", 0)
    if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise BadRequest(f"'top_logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}]", param="top_logprobs")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string", param="model")
    return ScoreRequest(context, messages, responses, top, routing, model)


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
    usage = payload.get("usage") or {}
    out = {"token_ids": response, "logprobs": logprobs, "prompt_tokens": usage.get("prompt_tokens", n),
           "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0}
    if top:
        out["top_logprobs"] = alternatives
    return out


async def _score_one(dispatcher, placement: Placement, req: ScoreRequest, context: list[int],
                     cap: ScoringCap, response: list[int], use_cap: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": req.model or dispatcher.pool.model, "prompt": context + response,
                            "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": req.top_logprobs}
    body["vllm_xargs"] = {DETOKENIZE_KEY: False}  # we read rows by token id; ignored without the plugin
    if use_cap:
        body["vllm_xargs"][SCORE_START_KEY] = cap.start
    if placement.cache_salt is not None:
        body["cache_salt"] = placement.cache_salt
    rid = placement.replica_id
    dispatcher.pool.acquire(rid)
    try:
        result = await post_json(dispatcher.http, placement.base_url + "/v1/completions", body)
    finally:
        dispatcher.pool.release(rid)
    if 400 <= result.status < 500:
        raise _replica_rejection(result)
    if result.status != 200 or not isinstance(result.payload, dict):
        raise UpstreamError(f"replica {rid} failed a scoring request with HTTP {result.status}")
    return _rows(result.payload, len(context), response, req.top_logprobs)


def _replica_rejection(result) -> RouterError:
    """A replica's 4xx as our error: its status, and its ``param`` when it names one."""
    error = result.payload.get("error", {}) if isinstance(result.payload, dict) else {}
    message = error.get("message") or result.raw[:200].decode("utf-8", "replace")
    exc = RouterError(f"replica rejected the scoring request: {message}",
                      param=router_param(error.get("param"), "score") or "responses")
    exc.status, exc.type = result.status, "invalid_request_error"
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
    """POST /v1/score handler."""
    req = parse_score(load_json_object(await request.read()), request.headers)
    tokenizer = request.app[keys.TOKENIZER]
    if req.messages is not None:
        context = await tokenizer.achat_ids(req.messages, add_generation_prompt=True)
    else:
        context = req.context if isinstance(req.context, list) else await tokenizer.acompletion_ids(req.context)
    tokenizer.check_ids(context, "context")
    for k, response in enumerate(req.responses):
        tokenizer.check_ids(response, f"responses[{k}]")
    caps = [scoring_cap(len(context), len(context) + len(r)) for r in req.responses]
    dispatcher = request.app[keys.DISPATCHER]
    choice = dispatcher.salt_for(req.keys)
    view = dispatcher.request_view(context, req.keys, choice.salt, kind="score")
    new_tokens = sum(len(r) + 1 for r in req.responses)
    tried: list[str] = []
    while True:
        placement = await dispatcher.place_when_available(view, choice.salt, tried, choice)
        use_cap = dispatcher.pool.get(placement.replica_id).endpoint.scoring_cap
        ticket = None
        try:
            ticket = await dispatcher.admit(placement, view, new_tokens)
            results = await _gather_or_cancel((_score_one(dispatcher, placement, req, context, cap, r, use_cap)
                                             for cap, r in zip(caps, req.responses)))
            break
        except (UpstreamError, ReplicaUnreachable, ReplicaGone) as exc:
            tried.append(placement.replica_id)
            if len(tried) > 1:
                raise UpstreamError(f"scoring failed on {', '.join(tried)}: {exc}") from exc
            dispatcher.metrics.retries.labels("score_failed").inc()
        except RouterError as exc:
            if 400 <= exc.status < 500:  # the replica refused the batch: it cached none of its blocks
                dispatcher.policy.on_rejected(view, placement.decision)
            raise
        finally:
            dispatcher.release(ticket)
            dispatcher.policy.on_finished(view, placement.replica_id)
    return web.json_response({
        "replica": placement.replica_id, "context_tokens": len(context), "score_start": caps[0].start,
        "scoring_cap": use_cap,
        **{k: v for k, v in placement.annotation(req.keys.weight_version, dispatcher.weight_versions(placement)).items()
           if k in ("cache_salt", "weight_version", "weight_versions", "requested_weight_version")},
        "results": [{"index": k, **r} for k, r in enumerate(results)],
    }, headers=placement.headers())
