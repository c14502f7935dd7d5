"""Busy polling: the event loop polls without sleeping for a while after each request.

Why: on this project's VMs (and on cloud VMs generally) a router whose CPU goes idle between
requests loses its caches: the host lends the halted vCPU to others, and the router's Python
code and data come back from memory for the next request. Stage stamps in a served router read
3-4x the same code's time in a hot loop (NOTES "Hot path", sessions 13-17), and
``bench.h2h.ab`` measured ours at +1.63 ms added p50 idling between requests against +1.08 ms
polling (the same checkout, one run). Polling costs up to one CPU core while requests keep
coming, and nothing once they stop for ``router.busy_poll_ms``; ScyllaDB's Seastar
(``--idle-poll-time-us``) and Linux's ``net.core.busy_poll`` make the same trade.

How: :meth:`BusyPoll.kick` (each request's start and end, ``router.metrics.metrics_middleware``)
moves the deadline to ``window_s`` from now and, unless the loop polls already, schedules a
callback that schedules itself again (``loop.call_soon``) until the deadline passes: a loop with
a ready callback polls its sockets with a zero timeout instead of blocking in ``epoll_wait``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


class BusyPoll:
    """Keeps the running event loop polling for ``window_s`` seconds after each :meth:`kick`.

    ``count(seconds)``: told the wall-clock seconds spent polling, as they pass (at each kick and
    when a poll ends: ``rollout_router_busy_poll_seconds``). Event-loop only; ``window_s`` > 0
    (0 turns busy polling off: build none)."""

    def __init__(self, window_s: float, count: Callable[[float], None] = lambda _: None) -> None:
        if not window_s > 0:
            raise ValueError(f"busy poll window must be > 0 seconds, got {window_s!r}")
        self.window_s = window_s
        self.count = count
        self.polling = False
        """Whether the loop polls now (a spin callback is scheduled)."""
        self._until = 0.0
        """When polling stops (``time.monotonic``) unless kicked again."""
        self._counted_to = 0.0
        """Up to when the polling time was counted (``time.monotonic``)."""
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None

    def kick(self) -> None:
        """Poll until ``window_s`` from now (a request started or ended)."""
        now = time.monotonic()
        self._until = now + self.window_s
        if self.polling:
            self.count(now - self._counted_to)
            self._counted_to = now
        elif not self._closed:
            self.polling, self._counted_to = True, now
            if self._loop is None:
                self._loop = asyncio.get_running_loop()
            self._loop.call_soon(self._spin)

    def _spin(self) -> None:
        now = time.monotonic()
        if now < self._until and not self._closed:
            self._loop.call_soon(self._spin)  # type: ignore[union-attr]
            return
        self.polling = False
        self.count(now - self._counted_to)

    def close(self) -> None:
        """Stop polling now and for good (the router is stopping)."""
        self._closed = True


__all__ = ["BusyPoll"]
