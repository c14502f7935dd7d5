"""The floor for a Python router: an aiohttp pass-through proxy with no routing logic at all.

It reads each ``POST /v1/completions`` body as bytes and posts it unchanged to the next upstream
(round-robin), on warm keep-alive connections and uvloop, as ``rollout-router serve`` does, and
answers with the upstream's bytes. Nothing is parsed, checked, hashed, decided or counted. Its
added latency in ``bench.h2h``'s latency run is what aiohttp and the event loop alone cost on the
machine; ours minus it is what the router's own work costs (parsing, block hashes, the decision
core, metrics).

    python -m bench.h2h.passthrough --port 8100 http://127.0.0.1:8001 http://127.0.0.1:8002
"""

from __future__ import annotations

import argparse
import asyncio
import itertools

import aiohttp
import uvloop
from aiohttp import web

from router.upstream import ReplicaClient


async def serve(port: int, upstreams: list[str], client: str = "aiohttp") -> None:
    """Serve on ``127.0.0.1:port`` until cancelled. ``client``: ``aiohttp`` (its ClientSession) or
    ``lean`` (``router.upstream.ReplicaClient``, which ours uses for answers read whole): with
    ``lean`` the floor is the aiohttp server alone, so ours minus it is the router's own work."""
    http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=300))
    lean = ReplicaClient(timeout_s=300)
    nxt = itertools.cycle(upstreams).__next__

    async def completions(request: web.Request) -> web.Response:
        body = await request.read()
        if client == "lean":
            status, answer = await lean.post(nxt() + "/v1/completions", body)
            return web.Response(body=answer, status=status, content_type="application/json")
        async with http.post(nxt() + "/v1/completions", data=body,
                             headers={"Content-Type": "application/json"}) as upstream:
            return web.Response(body=await upstream.read(), status=upstream.status,
                                content_type="application/json")

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
        await http.close()
        await lean.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.h2h.passthrough", description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("upstreams", nargs="+", help="replica base URLs")
    p.add_argument("--client", choices=["aiohttp", "lean"], default="aiohttp",
                   help="how it posts upstream: aiohttp's client (default) or the router's lean one")
    args = p.parse_args(argv)
    try:
        uvloop.run(serve(args.port, [u.rstrip("/") for u in args.upstreams], args.client))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
