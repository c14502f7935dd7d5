"""Changing a running ReplicaSet's membership: ``add`` a replica, ``remove`` one (optionally drained).

A mixin of :class:`~replicas.replica_set.ReplicaSet` (it uses the set's launch, wrap and stop
helpers); used by the router's ``/admin/replicas``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from cache_policy.types import ReplicaId
from replicas import ops
from replicas.ids import replica_index

DRAIN_POLL_S = 0.5
logger = logging.getLogger(__name__)


class Membership:
    """``add`` / ``remove`` for ReplicaSet (see there for the attributes used)."""

    async def add(self, url: str | None = None):
        """Start one more replica from ``cfg`` (or wrap the server at ``url``) under a new
        index, wait until it is ready, publish ``added`` and return its endpoint."""
        self._require_started()
        index = self._take_index()
        if url is not None:
            endpoint = await self._wrap(index, url.rstrip("/"), "the url")
        else:
            if not self._model_path:
                from replicas.server import resolve_model

                self._model_path = await asyncio.to_thread(resolve_model, self.cfg)
            await self._init_ray()
            endpoint = await self._launch(index)
        self.events.publish("added", endpoint.replica_id, endpoint)
        return endpoint

    async def remove(self, rid: ReplicaId, *, drain_timeout_s: float | None = None,
                     idle: Callable[[], Awaitable[bool]] | None = None) -> bool:
        """Take replica ``rid`` out for good and publish ``removed``; ``KeyError`` if unknown.

        ``drain_timeout_s`` None: stop it at once. Else publish ``draining`` first and wait, at
        most that many seconds, until it is idle: ``idle()`` if given (the router's own view, e.g.
        nothing in flight there), else its ``/metrics`` showing no running or waiting request.
        Returns True when it was idle (or not drained), False when the drain timed out.
        """
        index = replica_index(rid)
        endpoint = self._endpoints[index]
        self._leaving.add(index)
        self._supervisor.forget(index)
        drained = True
        if drain_timeout_s is not None:
            self.events.publish("draining", rid, endpoint, f"drain within {drain_timeout_s:g} s")
            # The router places no new work there only once it has handled ``draining``: an idle
            # check before that could pass between two requests and stop the replica while a
            # request is being placed on it (it went out without the key: a 401 to the client).
            await self._delivered(max(drain_timeout_s, 1.0))
            drained = await self._wait_idle(endpoint, drain_timeout_s, idle)
        await self._drop(index)
        self.events.publish("removed", rid, endpoint, "removed" if drained else "drain timed out; stopped")
        return drained

    async def _delivered(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self.events.flush(), timeout_s)
        except asyncio.TimeoutError:
            logger.warning("replica events: a handler is still busy after %g s; draining on", timeout_s)

    async def _wait_idle(self, endpoint, timeout_s: float,
                         idle: Callable[[], Awaitable[bool]] | None) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if await idle() if idle is not None else await self._replica_idle(endpoint):
                    return True
            except Exception as exc:  # noqa: BLE001 - an unreadable replica is not idle; keep waiting
                logger.debug("drain of %s: idle check failed: %r", endpoint.replica_id, exc)
            await asyncio.sleep(DRAIN_POLL_S)
        return False

    async def _replica_idle(self, endpoint) -> bool:
        m = await ops.fetch_metrics(self._session, endpoint.base_url)
        return m.num_running + m.num_waiting == 0
