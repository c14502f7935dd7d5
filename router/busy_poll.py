"""Busy polling: the event loop polls without sleeping for a while after each request.

Why: a router whose loop sleeps between requests wakes up for the next one on a halted vCPU
(on this project's VMs: no ``cpuidle`` driver, each idle vCPU halts and the host must schedule it
again), and that wake-up, not the router's own work, is most of what polling saves: stage stamps
in a served router read its request path at ~650 us polling against ~770 us sleeping, while
``bench.h2h.ab`` measured the added latency at +0.92 ms polling against +1.27 ms for the same
checkout (one run, NOTES "Busy polling and registry races"). Polling only while a request waits
on its replica saved nothing: the wake-up that costs is the request's arrival. vLLM's own engine
core polls its queue for a second after each message; ScyllaDB's Seastar
(``--idle-poll-time-us``) and Linux's ``net.core.busy_poll`` make the same trade: up to one CPU
core while requests keep coming, nothing once they stop for ``router.busy_poll_ms``.

How: :meth:`BusyPoll.kick` (as each API request the edge let in ends,
``router.metrics.metrics_middleware``) moves the deadline to ``window_s`` from now and, unless
the loop polls already, schedules a callback that schedules itself again (``loop.call_soon``)
until the deadline passes: a loop with a ready callback polls its sockets with a zero timeout
instead of blocking in ``epoll_wait``. It makes no garbage (no collection ran over 0.4 s of it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


class BusyPoll:
    """Keeps the running event loop polling for ``window_s`` seconds after each :meth:`kick`.

    ``count(seconds)``: told the wall-clock seconds spent polling (when a poll ends, and up to now
    at :meth:`count_now`: ``rollout_router_busy_poll_seconds``). Event-loop only; ``window_s`` > 0
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
        """Poll until ``window_s`` from now (a request ended)."""
        now = time.monotonic()
        self._until = now + self.window_s
        if not self.polling and not self._closed:
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

    def count_now(self, now: float | None = None) -> None:
        """Count the polling time up to ``now`` (``time.monotonic``; default: now), as a
        ``/metrics`` scrape does first (``RouterMetrics.before_scrape``)."""
        if self.polling:
            now = time.monotonic() if now is None else now
            self.count(now - self._counted_to)
            self._counted_to = now

    def close(self) -> None:
        """Stop polling now and for good (the router is stopping)."""
        self._closed = True


__all__ = ["BusyPoll"]
