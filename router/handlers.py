"""HTTP handlers: parse, tokenize, hand to the request lifecycle. No routing logic lives here."""

from __future__ import annotations

from aiohttp import web

from router import fleet, keys
from router.errors import echo
from router.generate import forward
from router.intake import read_chat, read_completion
from router.parse import key_text
from router.schemas import openapi_document


async def completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/completions: prompt as text or token IDs; streaming or not."""
    parsed, token_ids = await read_completion(request)
    return await forward(request, parsed, token_ids)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions: messages rendered as vLLM renders them (``router.tokenize``)."""
    parsed, token_ids = await read_chat(request)
    return await forward(request, parsed, token_ids)


async def openapi(request: web.Request) -> web.Response:
    """GET /openapi.json: the router's OpenAPI document, built from its request models."""
    return web.json_response(openapi_document())


async def models(request: web.Request) -> web.Response:
    """GET /v1/models: the served model, as one OpenAI model object."""
    name = request.app[keys.POOL].model
    return web.json_response({"object": "list", "data": [
        {"id": name, "object": "model", "owned_by": "rollout-router", "root": name}]})


async def health(request: web.Request) -> web.Response:
    """GET /health: 200 while at least one healthy replica is in rotation, else 503; lists replicas."""
    replicas = fleet.replica_rows(request.app)
    ok = any(r["healthy"] and r["in_rotation"] for r in replicas)
    return web.json_response({"status": "ok" if ok else "unavailable", "replicas": replicas},
                             status=200 if ok else 503)


async def end_session(request: web.Request) -> web.Response:
    """DELETE /v1/sessions/{session_id}: the client is done with the session; its pin and parked
    prefix are released at once (idle expiry remains for clients that never say so). 200 either
    way: ``"ended": true`` when the router held the session, ``false`` (with a ``message``) when
    it held nothing to end (never seen, already ended, or expired idle). With shared state its pin
    goes from Redis too and every router ends it (``router.state.pins.PinSync.end``): a new
    session under the same id starts fresh everywhere (replica, start version)."""
    session_id = key_text("session_id", request.match_info["session_id"], request.app[keys.LIMITS])
    life = request.app[keys.LIFECYCLE]
    here = request.app[keys.CORE].end_session(session_id)
    shared = await life.shared.end_session(session_id) if life.shared is not None else False
    if not (here or shared):
        return web.json_response({"session_id": session_id, "ended": False, "message": (
            f"no session {echo(session_id)!r} on this router: never seen, already ended, or expired idle")})
    life.pump()
    return web.json_response({"session_id": session_id, "ended": True})
