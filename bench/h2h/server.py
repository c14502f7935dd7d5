"""Simulated vLLM replicas over HTTP: one process, one loopback port per replica.

Each port speaks what the routers call (read from their sources: vllm-router and sglang-router
probe ``/health`` and forward ``/v1/completions``; ours also reads ``/v1/models`` and ``/metrics``):

* ``POST /v1/completions``: ``prompt`` as token IDs or text, ``max_tokens`` (default 16), ``n``,
  ``cache_salt``; answers vLLM's JSON (``usage.prompt_tokens_details.cached_tokens``) once the
  engine model finishes the request. ``stream: true`` is refused (400): the benchmark does not use it.
* ``GET /health``, ``GET /v1/models`` (``root``: the tokenizer folder, so our router loads the same
  tokenizer), ``GET /metrics`` (vLLM's series, ``bench.h2h.replica.SimReplica.metrics_text``),
  ``POST /tokenize`` (``{"prompt": text}`` -> ``tokens``).
* ``GET /sim/stats`` (the engine's counters) and ``POST /sim/reset`` (a fresh engine): the benchmark's own.

Text is tokenized with the given Hugging Face tokenizer folder (the tiny model's by default, so a
text prompt becomes the same IDs here as in our router), BOS added as vLLM's completions add it;
except text made only of ``t<id>`` words (``spell_ids``): a trivial, exact tokenizer that carries
token-ID workloads through routers whose ``/v1/completions`` takes text only (sglang-router 0.3.2
refuses a list of ints: "data did not match any variant of untagged enum StringOrArray").
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

from aiohttp import web

from bench.h2h.replica import SimReplica

MODEL = "sim-model"
REPLICA = web.AppKey("replica", SimReplica)
TOKENIZER = web.AppKey("tokenizer", object)
ROOT = web.AppKey("root", str)


def _bad(message: str, param: str | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "BadRequestError", "param": param,
                                        "code": 400}}, status=400)


_SPELLED = re.compile(r"t\d+(?: t\d+)*")


def spell_ids(token_ids: list[int]) -> str:
    """Token IDs as text this replica tokenizes back exactly: ``[5, 17]`` -> ``"t5 t17"``."""
    return " ".join(f"t{t}" for t in token_ids)


def _encode(app: web.Application, text: str, add_special: bool = True) -> list[int]:
    if _SPELLED.fullmatch(text):
        return [int(w[1:]) for w in text.split(" ")]
    tok = app[TOKENIZER]
    if tok is None:
        raise ValueError("this replica has no tokenizer: send token IDs")
    return list(tok(text, add_special_tokens=add_special)["input_ids"])


def _prompt_ids(app: web.Application, body: dict[str, Any]) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return _encode(app, prompt, body.get("add_special_tokens", True))
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        return _prompt_ids(app, {**body, "prompt": prompt[0]})
    raise ValueError("'prompt' must be text or a non-empty list of token IDs")


async def completions(request: web.Request) -> web.Response:
    """``POST /v1/completions`` through the engine model (non-streamed)."""
    try:
        body = json.loads(await request.read())
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
        if body.get("stream"):
            return _bad("stream is not supported by the simulated replica", "stream")
        ids = _prompt_ids(request.app, body)
        max_tokens, n = int(body.get("max_tokens") or 16), int(body.get("n") or 1)
    except (ValueError, TypeError) as exc:
        return _bad(str(exc), "prompt")
    replica = request.app[REPLICA]
    salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
    answers = await asyncio.gather(*(replica.generate(ids, max_tokens, salt) for _ in range(n)))
    out = sum(a.output_tokens for a in answers)
    return web.json_response({
        "id": f"cmpl-{replica.name}-{time.monotonic_ns()}", "object": "text_completion", "created": int(time.time()),
        "model": body.get("model") or MODEL,
        "choices": [{"index": i, "text": "", "logprobs": None, "finish_reason": "length", "stop_reason": None}
                    for i in range(n)],
        "usage": {"prompt_tokens": len(ids), "completion_tokens": out, "total_tokens": len(ids) + out,
                  "prompt_tokens_details": {"cached_tokens": answers[0].cached_tokens}},
    })


async def tokenize(request: web.Request) -> web.Response:
    """``POST /tokenize``: ``{"prompt": text}`` -> ``{"tokens": [...], "count": n}``."""
    try:
        body = json.loads(await request.read())
        ids = _encode(request.app, body["prompt"], body.get("add_special_tokens", True))
    except (ValueError, TypeError, KeyError) as exc:
        return _bad(f"'prompt' must be text ({exc})", "prompt")
    return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": 16384})


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [
        {"id": MODEL, "object": "model", "created": 0, "owned_by": "vllm", "root": request.app[ROOT],
         "parent": None, "max_model_len": 16384}]})


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def metrics(request: web.Request) -> web.Response:
    return web.Response(text=request.app[REPLICA].metrics_text(MODEL), content_type="text/plain")


async def sim_stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[REPLICA].stats())


async def sim_reset(request: web.Request) -> web.Response:
    request.app[REPLICA].reset()
    return web.json_response({"reset": True})


def replica_app(replica: SimReplica, tokenizer: Any, root: str) -> web.Application:
    """The aiohttp app of one simulated replica (``tokenizer``: a HF tokenizer or None)."""
    app = web.Application(client_max_size=256 * 1024 * 1024)
    app[REPLICA], app[TOKENIZER], app[ROOT] = replica, tokenizer, root
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/sim/stats", sim_stats)
    app.router.add_post("/sim/reset", sim_reset)
    return app


async def serve(replicas: list[SimReplica], tokenizer: Any, root: str, host: str = "127.0.0.1") -> list[str]:
    """Start one site per replica on free loopback ports; return their base URLs (kept running)."""
    urls = []
    for replica in replicas:
        runner = web.AppRunner(replica_app(replica, tokenizer, root), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, 0)
        await site.start()
        port = runner.addresses[0][1]
        urls.append(f"http://{host}:{port}")
    return urls
