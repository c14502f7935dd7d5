"""update_weights / reset_prefix_cache_confirmed without vLLM: argument checks, result invariants,
and what a reset that never says "success" comes to (small fake servers for those edge cases;
the behaviour on real vLLM is in test_weights_vllm.py)."""

from __future__ import annotations

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from replicas.weights import WeightUpdateResult, reset_prefix_cache_confirmed, update_weights
from replicas.weights_reset import reset_prefix_cache_outcome

# asyncio_mode = auto with the session loop scope comes from pyproject.toml.


@pytest_asyncio.fixture(loop_scope="session")
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.mark.parametrize("kwargs, knob", [
    ({"weights_path": ""}, "weights_path"),
    ({"pause_mode": "drain"}, "pause_mode"),
    ({"preempt_running": True, "reset_prefix_cache": False}, "preempt_running"),
])
async def test_caller_mistakes_raise_value_error_naming_the_knob(http, kwargs, knob):
    args = {"weights_path": "/ckpt", "reset_prefix_cache": True, **kwargs}
    with pytest.raises(ValueError, match=knob):
        await update_weights(http, "http://127.0.0.1:9", **args)


def test_result_invariants():
    WeightUpdateResult(ok=True, reset_confirmed=None, error=None, seconds=0.1, weights="new", resumed=True)
    with pytest.raises(AssertionError):
        WeightUpdateResult(ok=True, reset_confirmed=False, error=None, seconds=0.1, weights="new", resumed=True)
    with pytest.raises(AssertionError):
        WeightUpdateResult(ok=False, reset_confirmed=None, error=None, seconds=0.1, weights="new", resumed=True)


async def test_unreachable_replica_is_reported_not_raised(http):
    result = await update_weights(http, "http://127.0.0.1:9", "/ckpt", reset_prefix_cache=True,
                                  pause_timeout_s=5)
    assert not result.ok and result.weights == "previous" and not result.resumed, result
    assert "pause" in result.error and "resume failed" in result.error


@pytest_asyncio.fixture(loop_scope="session")
async def serve():
    """Start a tiny aiohttp app on a free port; yields ``start(routes) -> base_url``."""
    runners = []

    async def start(routes) -> str:
        app = web.Application()
        app.add_routes(routes)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    yield start
    for runner in runners:
        await runner.cleanup()


async def test_a_refused_reset_is_retried_then_reported_false(http, serve):
    calls = []

    async def refuse(request):
        calls.append(request.query.get("reset_running_requests"))
        return web.json_response({"success": False})

    url = await serve([web.post("/reset_prefix_cache", refuse)])
    outcome = await reset_prefix_cache_outcome(http, url, timeout_s=2.0, retry_interval_s=0.1)  # 0.5 s: 2 tries on a busy host
    assert not outcome.confirmed and outcome.attempts == len(calls) >= 3, outcome
    assert "refused" in outcome.detail and calls[0] is None
    assert not await reset_prefix_cache_confirmed(http, url, timeout_s=0, preempt_running=True)
    assert calls[-1] == "true"


async def test_no_verdict_on_a_paused_engine_is_not_confirmed(http, serve):
    async def no_verdict(request):
        return web.Response(status=200)  # what vLLM before {"success": ...} answered

    async def paused(request):
        return web.json_response({"is_paused": True})

    url = await serve([web.post("/reset_prefix_cache", no_verdict), web.get("/is_paused", paused)])
    outcome = await reset_prefix_cache_outcome(http, url, timeout_s=1)
    assert not outcome.confirmed and "paused" in outcome.detail, outcome


async def _probe_only_server(serve, complete) -> str:
    """A server whose reset gives no verdict (so the probe decides), unpaused, serving model
    ``m``, whose ``/v1/completions`` is ``complete``."""

    async def no_verdict(request):
        return web.Response(status=200)

    async def idle(request):
        return web.json_response({"is_paused": False})

    async def models(request):
        return web.json_response({"data": [{"id": "m"}]})

    return await serve([web.post("/reset_prefix_cache", no_verdict), web.get("/is_paused", idle),
                        web.get("/v1/models", models), web.post("/v1/completions", complete)])


async def test_no_verdict_and_a_probe_that_cannot_hit_is_not_confirmed(http, serve):
    async def complete(request):  # a server without --enable-prompt-tokens-details
        return web.json_response({"usage": {"prompt_tokens": 257}})

    url = await _probe_only_server(serve, complete)
    assert not await reset_prefix_cache_confirmed(http, url, timeout_s=1)
    outcome = await reset_prefix_cache_outcome(http, url, timeout_s=1)
    assert not outcome.confirmed and "no usage.prompt_tokens_details.cached_tokens" in outcome.detail, outcome


async def test_a_probe_request_that_fails_says_why(http, serve):
    async def overloaded(request):
        return web.json_response({"error": {"message": "engine overloaded"}}, status=503)

    url = await _probe_only_server(serve, overloaded)
    outcome = await reset_prefix_cache_outcome(http, url, timeout_s=1)
    assert not outcome.confirmed, outcome
    assert "cached tokens [None, None]; probe request: HTTP 503: engine overloaded" in outcome.detail, outcome


async def test_dev_mode_off_fails_fast(http, serve):
    url = await serve([])  # every dev endpoint 404s, as with VLLM_SERVER_DEV_MODE unset
    outcome = await reset_prefix_cache_outcome(http, url, timeout_s=30)
    assert not outcome.confirmed and outcome.attempts == 1 and "404" in outcome.detail
    result = await update_weights(http, url, "/ckpt", reset_prefix_cache=True)
    assert not result.ok and result.weights == "previous" and "404" in result.error, result


async def test_a_server_without_dev_mode_refuses_the_pause_and_serves_on_unpaused(http, serve):
    # vLLM without VLLM_SERVER_DEV_MODE=1 has no /pause, /resume or /collective_rpc (404): the
    # engine was never paused, so the update fails naming the missing mode, without a resume, and
    # the replica counts as resumed on its previous weights (it goes back in rotation); a fresh
    # user's external servers all stayed out of rotation for good after one update
    calls = []

    async def anything(request: web.Request) -> web.Response:
        calls.append(request.path)
        return web.Response(status=404, text='{"detail": "Not Found"}', content_type="application/json")

    base = await serve([web.post("/{tail:.*}", anything)])
    result = await update_weights(http, base, "/ckpt", reset_prefix_cache=True)
    assert not result.ok and result.weights == "previous" and result.resumed, result
    assert "VLLM_SERVER_DEV_MODE=1" in result.error and "resume" not in result.error, result.error
    assert calls == ["/pause"]
