"""Replica events: what the replica set tells its router about replicas coming, going and failing.

Subscribe with :meth:`ReplicaSet.subscribe <replicas.replica_set.ReplicaSet.subscribe>`; a
handler is a plain function or a coroutine function taking one :class:`ReplicaEvent`. Events
reach every handler in the order they were published, one at a time, from one dispatcher task
(a handler that blocks delays the next event, never the supervisor). A handler that raises is
logged once per (handler, exception type) and keeps receiving events.

Kinds, and what a router does on each:

=============  ==============================================================================
``added``      a new replica is ready (healthy; scoring cap probed): add it (``endpoint``)
``unhealthy``  a health check failed (``reason``): out of rotation, keep its state
``healthy``    health is back after ``unhealthy``, same process and URL: back in rotation
``restarting`` the replica is being restarted (``reason``): out of rotation; its cache is lost
``restarted``  ready again at a NEW ``endpoint`` (URL, key): forget its prefix-index entries
               and pins, use the new endpoint, back in rotation
``draining``   ``remove(drain_timeout_s=...)`` began: send it no new work
``removed``    gone for good (removed, or its restart budget is spent: ``reason``): drop it
=============  ==============================================================================
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Literal, Union

from cache_policy.types import ReplicaId

log = logging.getLogger(__name__)

EventKind = Literal["added", "unhealthy", "healthy", "restarting", "restarted", "draining", "removed"]
Handler = Callable[["ReplicaEvent"], Union[None, Awaitable[None]]]


@dataclass(frozen=True)
class ReplicaEvent:
    """One change to one replica. ``endpoint`` is the replica's current
    :class:`~replicas.replica_set.ReplicaEndpoint` (the new one for ``added``/``restarted``,
    the last known one otherwise)."""

    kind: EventKind
    replica_id: ReplicaId
    endpoint: Any
    reason: str = ""
    seq: int = field(default=0, compare=False)
    """Publication order, from 1 (set by the bus)."""


class EventBus:
    """Ordered fan-out of :class:`ReplicaEvent` to subscribed handlers (see the module doc)."""

    def __init__(self) -> None:
        self._handlers: list[Handler] = []
        self._queue: asyncio.Queue[ReplicaEvent] | None = None
        self._task: asyncio.Task | None = None
        self._seq = 0
        self._logged: set[tuple[int, str]] = set()

    def subscribe(self, handler: Handler) -> Callable[[], None]:
        """Add ``handler``; returns a function that removes it."""
        self._handlers.append(handler)
        return lambda: self._handlers.remove(handler) if handler in self._handlers else None

    def publish(self, kind: EventKind, replica_id: ReplicaId, endpoint: Any, reason: str = "") -> ReplicaEvent:
        """Queue one event for delivery (never blocks, never raises); returns it."""
        self._seq += 1
        event = ReplicaEvent(kind, replica_id, endpoint, reason, self._seq)
        log.info("replica event %d: %s %s %s", event.seq, kind, replica_id, reason)
        self._ensure_running().put_nowait(event)
        return event

    async def flush(self) -> None:
        """Wait until every event published so far has been handled by every handler."""
        if self._queue is not None:
            await self._queue.join()

    async def close(self, timeout_s: float = 10.0) -> None:
        """Deliver what is queued (at most ``timeout_s`` more), then stop the dispatcher."""
        try:
            await asyncio.wait_for(self.flush(), timeout_s)
        except asyncio.TimeoutError:
            log.warning("replica events: handlers still busy after %g s at close; dropping the rest", timeout_s)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._task, self._queue = None, None

    def _ensure_running(self) -> asyncio.Queue:
        if self._queue is None or self._task is None or self._task.done():
            self._queue = self._queue or asyncio.Queue()
            self._task = asyncio.get_running_loop().create_task(self._dispatch(self._queue))
        return self._queue

    async def _dispatch(self, queue: asyncio.Queue) -> None:
        while True:
            event = await queue.get()
            try:
                for handler in list(self._handlers):
                    await self._deliver(handler, event)
            finally:
                queue.task_done()

    async def _deliver(self, handler: Handler, event: ReplicaEvent) -> None:
        try:
            result = handler(event)
            if inspect.isawaitable(result):
                await result
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - one bad subscriber must not stop the others
            cause = (id(handler), type(exc).__name__)
            if cause not in self._logged:
                self._logged.add(cause)
                log.exception("replica event handler %r failed on %s (logged once per cause)", handler, event.kind)
