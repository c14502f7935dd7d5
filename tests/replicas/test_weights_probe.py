"""``replicas.weights_reset.confirm_by_probe`` against a small fake engine on loopback: the probe's
verdicts without a real vLLM (``test_weights_vllm.py`` runs them on one)."""

from __future__ import annotations

import functools

import aiohttp
import pytest
from aiohttp import web

from replicas.weights_http import call
from replicas.weights_reset import confirm_by_probe

pytestmark = pytest.mark.asyncio(loop_scope="function")


def fake_engine(first: list[int | None]) -> tuple[web.Application, dict]:
    """Answers the probe with the cached counts in ``first`` (None: HTTP 503), then as a prefix
    cache would: a prompt seen since the last reset hits all but its last block."""
    state = {"seen": set(), "probes": 0, "resets": 0}

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        state["probes"] += 1
        if first:
            cached = first.pop(0)
            if cached is None:
                return web.json_response({"error": {"message": "engine busy"}}, status=503)
        else:
            key = (body["cache_salt"], len(body["prompt"]))
            cached = 0 if key not in state["seen"] else (len(body["prompt"]) - 1) // 16 * 16
            state["seen"].add(key)
        return web.json_response({"choices": [{"text": "x"}], "usage": {
            "prompt_tokens": len(body["prompt"]), "prompt_tokens_details": {"cached_tokens": cached}}})

    async def reset(_: web.Request) -> web.Response:
        state["resets"] += 1
        state["seen"].clear()
        return web.Response(status=200)

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})

    async def paused(_: web.Request) -> web.Response:
        return web.json_response({"is_paused": False})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/reset_prefix_cache", reset)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/is_paused", paused)
    return app, state


@pytest.mark.parametrize("first", [[], [None]])
async def test_a_reset_is_confirmed_even_when_the_first_probe_got_no_answer(first):
    """The first probe request failing (a 503 from a busy engine: the CI saw ``[None, 0]``) cached
    nothing, so the second could not hit: one more probe, then the verdict."""
    app, state = fake_engine(list(first))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    try:
        async with aiohttp.ClientSession() as http:
            outcome = await confirm_by_probe(http, url, functools.partial(call, http, "POST", f"{url}/reset_prefix_cache"))
    finally:
        await runner.cleanup()
    assert outcome.confirmed, outcome
    assert state["resets"] == 1 and state["probes"] == 3 + len(first)  # two to prime and hit, one after
