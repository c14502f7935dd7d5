"""Completions and chat: the attempt that sends one prompt to the placed replica.

The lifecycle (``router.lifecycle``) decides and retries; this module builds the upstream body
(the engine sees exactly the token IDs the router hashed, with the core's cache salt), relays
the answer (JSON or an event stream) and counts what the replica prefilled.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from cache_policy.core import Job, RequestSpec
from replicas.replica_set import ReplicaEndpoint
from router import keys
from router.fastlane import FastRequest
from router.lifecycle import RetryElsewhere
from router.parse import ParsedRequest
from router.proxy import CACHED_TOKENS, FAILED, UpstreamResult, post_json, relay_stream
from router.responses import AnswerAhead, annotation, json_answer, route_headers, send_now
from router.weights.report import StreamWatch

UPSTREAM_PATH = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def new_tokens(body: dict[str, Any], default_max_tokens: int) -> int:
    """Tokens the request may generate over all its samples (``max_tokens * n``), for admission.
    ``max_completion_tokens`` wins over ``max_tokens`` when both are given, as vLLM's chat
    completions decide (``vllm/entrypoints/openai/chat_completion/serving.py``: ``get_max_tokens``
    of ``max_completion_tokens if not None else max_tokens``); completions refuse it (``router.parse``)."""
    limit = body.get("max_completion_tokens")
    if limit is None:
        limit = body.get("max_tokens")
    if limit is None:
        limit = default_max_tokens
    n = body.get("n") or 1
    return int(limit) * int(n) if isinstance(limit, int) and isinstance(n, int) else 0


def samples(body: dict[str, Any]) -> int:
    """Engine requests one completion runs: its ``n`` (``router.parse`` checked it is a positive int
    at most ``router.max_n``). vLLM's V1 engine splits a request with ``n`` into ``n`` child
    requests sharing the prompt's blocks (``vllm/v1/engine/parallel_sampling.py``), each decoding
    and holding its own output blocks, so load, pins and the in-flight cap count ``n`` (as a
    scoring fan-out counts K); the admission footprint counts the prompt once and every sample's
    output (:func:`new_tokens`)."""
    n = body.get("n")
    return n if isinstance(n, int) and n > 1 else 1


def upstream_body(parsed: ParsedRequest, token_ids: list[int], job: Job, model: str) -> dict[str, Any]:
    """The body sent to the replica: routing fields removed, token IDs and the cache salt set."""
    body = dict(parsed.body)
    if parsed.endpoint == "completions":
        body["prompt"] = token_ids  # the engine sees exactly the tokens the router hashed
    body.setdefault("model", model)
    if job.salt is not None:
        body["cache_salt"] = job.salt
    return body


async def forward(client: web.Request, parsed: ParsedRequest, token_ids: list[int]) -> web.StreamResponse:
    """Route and proxy a completion or chat request; the response names the replica."""
    app = client.app
    life, core, metrics = app[keys.LIFECYCLE], app[keys.CORE], app[keys.METRICS]
    cfg = app[keys.CONFIG].router
    expose = getattr(cfg, "expose_expected_cached_tokens", True)
    spec = RequestSpec(token_ids, parsed.keys.session_id, parsed.keys.group_id, parsed.keys.weight_version,
                       parsed.keys.tenant, "generate", new_tokens(parsed.body, cfg.admission_default_max_tokens),
                       fan_out=samples(parsed.body), ends_session=parsed.keys.end_session)

    async def attempt(job: Job, endpoint: ReplicaEndpoint) -> web.StreamResponse:
        body = upstream_body(parsed, token_ids, job, endpoint.model)
        url = endpoint.base_url + UPSTREAM_PATH[parsed.endpoint]
        flight = life.flight(job)
        if parsed.stream:
            watch = StreamWatch(flight.tokens, lambda cached: annotation(
                job, core, expose_cached=expose, cached=cached, spans=flight.spans, reruns=life.reruns.get(job.id, 0),
                tokens=flight.tokens))
            flight.watch = watch
            resp = await relay_stream(client, life.http, url, body, route_headers(job, expose_cached=expose), watch,
                                      start=lambda aborted: life.answer_starts(job, aborted))
        else:
            # on the fast lane a 200 is answered as its last byte is read (AnswerAhead), its
            # headers and annotation built while the replica works
            ahead = None
            if isinstance(client, FastRequest) and flight is not None:
                ahead = AnswerAhead(client, job, core, flight, expose_cached=expose, reruns=life.reruns.get(job.id, 0),
                                    starts=lambda aborted: life.answer_starts(job, aborted))
                asyncio.get_running_loop().call_soon(ahead.prepare)  # runs once the request is sent
            resp = await post_json(life.upstream, url, body, on_answer=None if ahead is None else ahead.deliver)
            if ahead is not None and ahead.sent is not None:  # the client has it (checked unmixed then)
                resp = ahead
        if isinstance(resp, AnswerAhead):
            cached, job.generated_tokens = resp.result.cached_tokens(), resp.result.completion_tokens()
            resp = resp.sent
        elif isinstance(resp, UpstreamResult):
            if resp.replica_failed():  # nothing reached the client yet
                raise RetryElsewhere(f"replica {endpoint.replica_id} answered HTTP {resp.status}: "
                                     f"{resp.raw[:200].decode('utf-8', 'replace')}")
            # never mixed nor partial: else run again (then answering: an update leaves it alone)
            life.answer_starts(job, resp.status == 200 and resp.aborted())
            cached = resp.cached_tokens()
            job.generated_tokens = resp.completion_tokens()
            resp = json_answer(resp, job, core, parsed.endpoint, expose_cached=expose, spans=flight.spans,
                               reruns=life.reruns.get(job.id, 0))
            resp = await send_now(client, resp)  # before the lifecycle releases the job, not after
        else:
            cached = resp.get(CACHED_TOKENS)
            job.generated_tokens = sum(flight.tokens.values())
        if resp.status == 200:  # prompts a replica refused were never prefilled
            # the prompt once, whatever n: vLLM's usage counts it (and its cached tokens) once, and
            # so do the predicted tokens (counted n times against one reported hit, a fresh user
            # read 4x the engine's hits predicted for n=4)
            metrics.count_prompt(job, len(token_ids), cached)
        return resp

    return await life.run(spec, attempt, status=lambda r: r.status,
                          failed=lambda r: r.get(FAILED) if isinstance(r, web.StreamResponse) else None,
                          streaming=parsed.stream)

