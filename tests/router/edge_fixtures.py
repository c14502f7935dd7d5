"""A router on loopback in front of a small fake replica, for edge cases no real engine is needed for.

The fake replica answers ``/v1/completions`` and ``/v1/chat/completions`` like vLLM (a 200 with
usage, ``prompt_logprobs`` rows when asked, or vLLM's 400 error shape when the body asks for it:
``temperature < 0``, a string ``seed``, or ``x_replica_param`` naming the ``param`` to refuse)
and records every body it receives. ``x_cached`` sets the cached tokens its usage reports,
``x_no_usage`` drops the usage, ``x_answer_extra`` adds members to its answer, ``x_aborts: n``
ends the first ``n`` such requests with ``finish_reason: "abort"`` (as a ``/pause?mode=abort`` does).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import aiohttp
from aiohttp import web

from replicas.config import ReplicaSetConfig
from replicas.replica_set import ReplicaEndpoint
from replicas.server import resolve_model
from router.config import AppConfig
from router.server import running_router
from router.tokenize import PromptTokenizer

VLLM_NULL_PARAM = {"message": "temperature must be non-negative, got -1.0.", "type": "BadRequestError",
                   "param": None, "code": 400}
"""vLLM 0.32's answer to ``temperature: -1`` (a SamplingParams check that names no ``param``)."""
VLLM_BODY_PARAM = {"message": "1 validation error:\n  {'type': 'int_parsing', 'loc': 'body.seed', 'msg': 'Input should "
                          "be a valid integer, unable to parse string as an integer', 'input': 'x'}",
                   "type": "Bad Request", "param": "body.seed", "code": 400}
"""vLLM 0.32's answer to ``seed: "x"`` (FastAPI's validation error: ``param`` is the joined pydantic location)."""


@dataclass
class FakeReplica:
    url: str
    bodies: list[dict[str, Any]] = field(default_factory=list)


def fake_replica_app(seen: list[dict[str, Any]]) -> web.Application:
    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        if "x_sleep_s" in body:  # a slow engine, for clients that leave mid-request
            await asyncio.sleep(body["x_sleep_s"])
        if body.get("temperature", 0) < 0:
            return web.json_response({"error": VLLM_NULL_PARAM}, status=400)
        if isinstance(body.get("seed"), str):
            return web.json_response({"error": VLLM_BODY_PARAM}, status=400)
        if "x_replica_param" in body:  # a refusal naming the field vLLM's way, as the body says
            return web.json_response({"error": {**VLLM_BODY_PARAM, "param": body["x_replica_param"]}}, status=400)
        prompt = body.get("prompt") or []
        choice: dict[str, Any] = {"index": 0, "text": "ok", "finish_reason": "length"}
        if "x_aborts" in body and sum("x_aborts" in b for b in seen) <= body["x_aborts"]:  # its first attempts
            choice.update(text="o", finish_reason="abort")  # as vLLM ends work a /pause?mode=abort stopped
        if body.get("prompt_logprobs") is not None:  # a scoring request: one row per prompt token but the first
            choice["prompt_logprobs"] = [None] + [{str(t): {"logprob": -0.5, "rank": 1}} for t in prompt[1:]]
        usage = {"prompt_tokens": len(prompt), "completion_tokens": 1,
                 "prompt_tokens_details": {"cached_tokens": body.get("x_cached", 0)}}
        if body.get("x_no_usage"):
            usage = None
        return web.json_response({"id": "x", "object": "text_completion", "choices": [choice], "usage": usage,
                                  **body.get("x_answer_extra", {})})

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_get("/health", health)
    return app


@contextlib.asynccontextmanager
async def fake_replica() -> AsyncIterator[FakeReplica]:
    """The fake replica on a free loopback port."""
    seen: list[dict[str, Any]] = []
    runner = web.AppRunner(fake_replica_app(seen), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield FakeReplica(f"http://127.0.0.1:{port}", seen)
    finally:
        await runner.cleanup()


_TOKENIZER: list[PromptTokenizer] = []


def tiny_tokenizer() -> PromptTokenizer:
    """The tiny model's tokenizer, loaded once per process (about 3 s)."""
    if not _TOKENIZER:
        _TOKENIZER.append(PromptTokenizer(resolve_model(ReplicaSetConfig())))
    return _TOKENIZER[0]


@contextlib.asynccontextmanager
async def edge_router(replica: FakeReplica, **router: Any) -> AsyncIterator[tuple[str, web.Application]]:
    """A router (``router`` overrides on ``AppConfig().router``) in front of ``replica``."""
    cfg = AppConfig().replace(router={"port": 0, "scrape_interval_s": 0, **router})
    endpoint = ReplicaEndpoint("replica-0", replica.url, 32, 1000, "tiny-llama")
    async with running_router(cfg, [endpoint], tiny_tokenizer()) as (url, app):
        yield url, app


async def post(url: str, path: str, *, json: Any = None, data: bytes | None = None,
               headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    """POST and return ``(status, JSON body)``."""
    async with aiohttp.ClientSession() as http:
        async with http.post(url + path, json=json, data=data, headers=headers) as r:
            return r.status, await r.json(content_type=None)
