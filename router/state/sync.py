"""The shared-state sync loop as an app cleanup context (``router.app``)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

from aiohttp import web

from router import keys


async def state_sync_ctx(app: web.Application) -> AsyncIterator[None]:
    """Join the shared state (bounded by its timeouts; Redis down: run local and join later),
    run its sync loop while the app serves, leave on shutdown."""
    state = app[keys.LIFECYCLE].shared
    await state.start(app, app[keys.CORE])
    task = asyncio.create_task(state.run())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
