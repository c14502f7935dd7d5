"""Graceful shutdown of a serving router: stop taking work, let in-flight requests finish.

``app[SHUTDOWN]`` (installed by ``router.server.running_router``) is the one switch:

1. :meth:`Shutdown.begin` sets ``draining``; from then on every new request is answered
   ``503`` with ``Retry-After`` by :func:`drain_middleware` (outermost, so no handler runs), and
   ``/health`` says ``draining`` (503) so load balancers look elsewhere;
2. it then calls the ``on_drain`` hooks, in order (sync or async; one that raises is logged
   and the rest still run). The admission queue registers one that answers every queued
   request ``503`` + ``Retry-After`` (``app[SHUTDOWN].on_drain.append(hook)``); a handler that
   wants to check the flag itself reads ``app[SHUTDOWN].draining``;
3. :meth:`Shutdown.wait_idle` waits until no request is inside a handler, at most the grace
   period (``router.shutdown_grace_s``). Whatever is still running after it (long streams) is
   cancelled by the runner's cleanup, which ends a relayed stream (the proxy's job to end it
   with an error event).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from typing import Awaitable, Callable, Union

from aiohttp import web

from router.errors import error_body

log = logging.getLogger(__name__)

RETRY_AFTER_S = 5
"""What a refused client is told to wait: about a restarted router's start-up."""
Hook = Callable[[], Union[None, Awaitable[None]]]


class Shutdown:
    """Draining state of one app: the flag, the hooks, the count of requests in handlers."""

    def __init__(self) -> None:
        self.draining = False
        self.on_drain: list[Hook] = []
        """Called once by :meth:`begin`, in order, after ``draining`` is set."""
        self._begun = False
        self.in_flight = 0
        """Requests inside a handler right now (counted by :func:`drain_middleware`)."""
        self._idle = asyncio.Event()
        self._idle.set()

    def refuse_new(self) -> None:
        """Refuse new work from now on, synchronously: for a signal handler, so that a request
        the event loop reads after the signal is refused even when the loop was starved long
        enough for both to arrive together (the drain coroutine needs several loop turns)."""
        self.draining = True

    async def begin(self) -> None:
        """Refuse new work from now on and run the ``on_drain`` hooks (once; a call after
        :meth:`refuse_new` still runs them)."""
        if self._begun:
            return
        self._begun = True
        self.draining = True
        for hook in self.on_drain:
            try:
                result = hook()
                if inspect.isawaitable(result):
                    await result
            except Exception:  # noqa: BLE001 - one failing hook must not stop the shutdown
                log.exception("shutdown hook %r failed", hook)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is in a handler, at most ``timeout_s``; True if it got there."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    def enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()


SHUTDOWN = web.AppKey("shutdown", Shutdown)


@web.middleware
async def drain_middleware(request: web.Request, handler):
    """503 + ``Retry-After`` for every request once draining; count the ones let in."""
    shutdown = request.app[SHUTDOWN]
    if shutdown.draining:
        return refused()
    shutdown.enter()
    try:
        return await handler(request)
    finally:
        shutdown.leave()


def refused() -> web.Response:
    """The answer to a request the stopping router will not serve (also for queued ones)."""
    body = error_body(503, "the router is shutting down; retry on another router or later")
    return web.json_response(body, status=503, headers={"Retry-After": str(RETRY_AFTER_S)})


def install(app: web.Application) -> Shutdown:
    """Put a :class:`Shutdown` and its middleware (outermost) on ``app``; before the app starts."""
    app[SHUTDOWN] = Shutdown()
    app.middlewares.insert(0, drain_middleware)
    return app[SHUTDOWN]


async def drain(app: web.Application, grace_s: float) -> bool:
    """Steps 1-3 of the module doc; True when every in-flight request finished in time."""
    shutdown = app[SHUTDOWN]
    await shutdown.begin()
    finished = await shutdown.wait_idle(grace_s)
    if not finished:
        log.warning("shutdown: %d request(s) still running after %g s; cutting them", shutdown.in_flight, grace_s)
    return finished
