"""router.shutdown on a real aiohttp server on loopback (no vLLM): drain order and answers."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from router.shutdown import SHUTDOWN, drain, install


async def _serve(app: web.Application):
    runner = web.AppRunner(app, shutdown_timeout=1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


async def test_drain_refuses_new_work_runs_hooks_and_waits_for_in_flight():
    release = asyncio.Event()
    calls: list[str] = []

    async def slow(request):
        await release.wait()
        return web.json_response({"done": True})

    app = web.Application()
    app.router.add_get("/slow", slow)
    shutdown = install(app)

    def broken_hook():
        calls.append("broken")
        raise RuntimeError("hook bug")

    async def queue_hook():
        calls.append("queue")

    shutdown.on_drain.extend([broken_hook, queue_hook])
    runner, url = await _serve(app)
    try:
        async with aiohttp.ClientSession() as http:
            in_flight = asyncio.create_task(http.get(url + "/slow"))
            while shutdown.in_flight == 0:
                await asyncio.sleep(0.01)
            draining = asyncio.create_task(drain(app, grace_s=30))
            while not shutdown.draining:
                await asyncio.sleep(0.01)
            async with http.get(url + "/slow") as refused:
                assert refused.status == 503 and refused.headers["Retry-After"] == "5"
                assert (await refused.json())["error"]["code"] == 503
            assert calls == ["broken", "queue"] and not draining.done()
            release.set()
            assert await draining is True
            resp = await in_flight
            assert resp.status == 200 and await resp.json() == {"done": True}
            resp.release()
    finally:
        await runner.cleanup()


async def test_drain_gives_up_after_the_grace_period():
    async def hang(request):
        await asyncio.sleep(3600)

    app = web.Application()
    app.router.add_get("/hang", hang)
    install(app)
    runner, url = await _serve(app)
    try:
        async with aiohttp.ClientSession() as http:
            task = asyncio.create_task(http.get(url + "/hang"))
            while app[SHUTDOWN].in_flight == 0:
                await asyncio.sleep(0.01)
            assert await drain(app, grace_s=0.3) is False and app[SHUTDOWN].in_flight == 1
            task.cancel()
    finally:
        await runner.cleanup()


async def test_a_stuck_cleanup_names_what_still_runs(monkeypatch, caplog):
    # a fresh attacker's update stuck on a hung engine: the shutdown said "stuck tasks: []"
    from router import server

    monkeypatch.setattr(server, "CLEANUP_TIMEOUT_S", 0.2)

    async def hung_weight_update() -> None:
        await asyncio.sleep(30)

    class Runner:
        async def cleanup(self) -> None:
            await task  # the app's cleanup waits on the update

    task = asyncio.get_running_loop().create_task(hung_weight_update())
    try:
        with caplog.at_level("ERROR", logger="router.server"):
            await server._bounded_cleanup(Runner())
    finally:
        task.cancel()
    assert "hung_weight_update" in caplog.text, caplog.text
