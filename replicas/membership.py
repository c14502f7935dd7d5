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


async def poll_until(check: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> bool:
    """Ask ``check()`` every ``DRAIN_POLL_S`` seconds, at least once (a drain of 0 s of an idle
    replica is a drained one), until it says True (then True) or ``timeout_s`` seconds passed
    (False). A ``check`` that raises counts as False (an unreadable replica is not idle)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if await check():
                return True
        except Exception as exc:  # noqa: BLE001 - an unreadable replica is not idle; keep waiting
            logger.debug("%s: check failed: %r", what, exc)
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(min(DRAIN_POLL_S, max(0.0, deadline - time.monotonic())))


class Membership:
    """``add`` / ``remove`` for ReplicaSet (see there for the attributes used)."""

    async def add(self, url: str | None = None, *, model: str | None = None):
        """Start one more replica from ``cfg`` (or wrap the server at ``url``, canonical: see
        ``replicas.addresses``) under a new index, wait until it is ready, publish ``added`` and
        return its endpoint. ``model``: the model the fleet serves; a server at ``url`` serving
        another is refused. StartupError when the server cannot be used; the new index comes from
        ``claim_index`` when set (shared state: unique across routers), taken only once the
        server at ``url`` answered as a replica (a refused one uses none up)."""
        self._require_started()
        if url is not None:
            endpoint = await self._wrap(None, url.rstrip("/"), "the url", model=model)
        else:
            index = await self._new_index()
            if not self._model_path:
                from replicas.server import resolve_model

                self._model_path = await asyncio.to_thread(resolve_model, self.cfg)
            await self._init_ray()
            endpoint = await self._launch(index)
        self.events.publish("added", endpoint.replica_id, endpoint)
        return endpoint

    async def _new_index(self) -> int:
        """The next free index: this set's own next one, or, with ``claim_index``, one no other
        router sharing state has used (at least this set's own next one)."""
        if self.claim_index is None:
            return self._take_index()
        return self._take_index(await self.claim_index(self._next_index))

    def owns(self, rid: ReplicaId) -> bool:
        """Whether replica ``rid`` is one of this set's (started or wrapped here, not removed)."""
        try:
            return replica_index(rid) in self._endpoints
        except KeyError:
            return False

    async def remove(self, rid: ReplicaId, *, drain_timeout_s: float | None = None,
                     idle: Callable[[], Awaitable[bool]] | None = None) -> bool:
        """Take replica ``rid`` out for good and publish ``removed``; ``KeyError`` if unknown or
        being removed already.

        ``drain_timeout_s`` None: stop it at once. Else publish ``draining`` first and wait, at
        most that many seconds, until it is idle: ``idle()`` if given (the router's own view, e.g.
        nothing in flight there), else its ``/metrics`` showing no running or waiting request.
        Returns True when it was idle (or not drained), False when the drain timed out.
        """
        index = replica_index(rid)
        endpoint = self._endpoints[index]
        if index in self._leaving:
            raise KeyError(f"replica {rid} is being removed already")
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
        return await poll_until(idle or (lambda: self._replica_idle(endpoint)), timeout_s,
                                f"drain of {endpoint.replica_id}")

    async def _replica_idle(self, endpoint) -> bool:
        m = await ops.fetch_metrics(self._session, endpoint.base_url)
        return m.num_running + m.num_waiting == 0
