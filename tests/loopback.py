"""A small aiohttp app on a free loopback port, for tests that need a server of their own."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from aiohttp import web


@contextlib.asynccontextmanager
async def app_on_loopback(app: web.Application) -> AsyncIterator[str]:
    """Serve ``app`` on 127.0.0.1 at a port the kernel picks; yields ``http://127.0.0.1:PORT``;
    stops it on exit."""
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()
