"""HTTP handlers: parse, tokenize, hand to the dispatcher. No routing logic lives here."""

from __future__ import annotations

from aiohttp import web

from router import keys
from router.parse import load_json_object, parse_chat, parse_completion


async def completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/completions: prompt as text or token IDs; streaming or not."""
    parsed = parse_completion(load_json_object(await request.read()), request.headers)
    prompt = parsed.prompt
    tokenizer = request.app[keys.TOKENIZER]
    if isinstance(prompt, list):
        tokenizer.check_ids(prompt, "prompt")
    token_ids = prompt if isinstance(prompt, list) else await tokenizer.acompletion_ids(prompt)
    return await request.app[keys.DISPATCHER].forward(request, parsed, token_ids)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions: messages rendered with the model's chat template."""
    parsed = parse_chat(load_json_object(await request.read()), request.headers)
    add_generation_prompt = bool(parsed.body.get("add_generation_prompt", True))
    token_ids = await request.app[keys.TOKENIZER].achat_ids(parsed.messages, add_generation_prompt)
    return await request.app[keys.DISPATCHER].forward(request, parsed, token_ids)


async def models(request: web.Request) -> web.Response:
    """GET /v1/models: the served model, as one OpenAI model object."""
    name = request.app[keys.POOL].model
    return web.json_response({"object": "list", "data": [
        {"id": name, "object": "model", "owned_by": "rollout-router", "root": name}]})


async def health(request: web.Request) -> web.Response:
    """GET /health: 200 while at least one healthy replica is in rotation, else 503; lists replicas."""
    pool = request.app[keys.POOL]
    rotation = request.app[keys.VERSIONS].rotation
    replicas = [{
        "replica": s.endpoint.replica_id, "url": s.endpoint.base_url, "healthy": s.healthy,
        "in_flight": s.in_flight, "kv_cache_usage": s.metrics.kv_cache_usage,
        "scoring_cap": s.endpoint.scoring_cap, "weight_version": s.weight_version,
        "in_rotation": s.endpoint.replica_id not in rotation,
        "out_of_rotation_reason": rotation.get(s.endpoint.replica_id),
    } for s in pool.states()]
    ok = any(r["healthy"] and r["in_rotation"] for r in replicas)
    return web.json_response({"status": "ok" if ok else "unavailable", "replicas": replicas},
                             status=200 if ok else 503)
