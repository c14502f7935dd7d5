"""Admission control on the event loop: ``cache_policy.admission`` decides, this module enforces.

A placed request asks :meth:`AdmissionController.acquire` for room on its replica before it is
forwarded. It is admitted at once, or waits (an asyncio future in the ``AdmissionQueue``) until a
release or a scrape makes room, or gets ``Overloaded`` (429 with Retry-After) when the queue is
full, it was displaced by a higher-priority request, or it waited past ``queue_timeout_s``.

What a replica holds, as the router projects it (``KvLedger``; blocks)::

    |<- max(scraped usage + unseen, committed) ->|<- parked ->|<- new ->|   <= watermark * blocks
     running requests: the replica's own metric,   live sessions   what this request adds
     or the router's in-flight peak, if larger     between turns

* committed: per in-flight request, the blocks it holds at its peak (prompt + max tokens;
  a started group's later members count only what they add beyond the shared prompt), so
  decode growth is reserved before it happens;
* unseen: of those, the requests admitted after the last scrape began (not in its usage);
* parked: the cached prefix of each live session between turns. vLLM counts those blocks
  as free (evictable), so its usage metric does not show them, but evicting them means
  prefilling the next turn again. A session unseen for ``session_idle_s`` stops counting.
* new: the request's peak blocks less what is already counted: its own session's parked
  prefix, or the prompt a started group's member shares with the group.

A replica with nothing in flight admits the first queued request whatever the projection
(``cache_policy.admission.fits``), so parked prefixes can slow new work but never stall it.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from cache_policy.admission import AdmissionQueue, AdmissionRequest, classify
from cache_policy.config import PolicyConfig
from cache_policy.sessions import SessionActivity
from cache_policy.types import ReplicaId, ReplicaView
from router.errors import Overloaded
from router.kv_ledger import KvLedger, Ticket
from router.pool import ReplicaPool


class ReplicaGone(Exception):
    """The replica a queued request waited for left rotation: place the request again."""


class AdmissionMetrics:
    """``rollout_router_admission_*`` series, registered in the router's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.admitted = Counter("rollout_router_admission_admitted", "Requests admitted, by replica and "
                                "whether they waited", ["replica", "waited"], registry=r)
        self.queued = Counter("rollout_router_admission_queued", "Requests that had to wait, by priority",
                              ["priority"], registry=r)
        self.rejected = Counter("rollout_router_admission_rejected", "Requests refused with 429, by reason "
                                "(queue_full, timeout, displaced)", ["reason"], registry=r)
        self.wait = Histogram("rollout_router_admission_queue_wait_seconds", "Time admitted requests waited",
                              registry=r, buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60))
        self.queue_length = Gauge("rollout_router_admission_queue_length", "Requests waiting", registry=r)
        self.projected = Gauge("rollout_router_admission_projected_kv_usage", "KV usage (0..1) the router "
                               "projects: running, reserved and parked blocks (the scraped value is "
                               "rollout_router_replica_kv_cache_usage)", ["replica"], registry=r)
        self.parked = Gauge("rollout_router_admission_parked_blocks", "Blocks of live sessions between turns",
                            ["replica"], registry=r)
        self.replica_requests = Gauge("rollout_router_replica_requests", "Requests the replica reported in its "
                                      "last scrape, by state (running, waiting)", ["replica", "state"], registry=r)
        self.replica_preemptions = Gauge("rollout_router_replica_preemptions", "The replica's own preemption "
                                         "count (vllm:num_preemptions_total) at its last scrape", ["replica"],
                                         registry=r)


@dataclass
class _Waiter:
    request: AdmissionRequest
    future: asyncio.Future
    blocks: int


class AdmissionController:
    """Admit, queue or reject placed requests; wake the queue on release and on each scrape.

    With ``enabled=False`` every request is admitted at once (the ledger and metrics still run).
    """

    def __init__(self, cfg: PolicyConfig, pool: ReplicaPool, registry: CollectorRegistry, *,
                 enabled: bool = True, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.pool = pool
        self.enabled = enabled
        self.clock = clock
        self.queue = AdmissionQueue(cfg)
        self.ledger = KvLedger()
        self.sessions = SessionActivity(cfg)
        self.groups = SessionActivity(cfg)
        self.metrics = AdmissionMetrics(registry)
        self.paused: set[ReplicaId] = set()
        self._waiters: dict[int, _Waiter] = {}
        self._numbers = itertools.count()

    async def acquire(self, rid: ReplicaId, total_blocks: int, matched_blocks: int, session_id: str | None,
                      group_id: str | None) -> Ticket:
        """Room on ``rid`` for a request of ``total_blocks`` at its peak (prompt + max tokens), of
        which the router expects ``matched_blocks`` cached; waits in the queue if needed.

        Raises ``Overloaded`` (429) or ``ReplicaGone`` (the replica left while it waited).
        """
        now = self.clock()
        request, blocks = self._request(rid, total_blocks, matched_blocks, session_id, group_id, now)
        if not self.enabled:
            return self._admit(request, blocks, now, waited=False)
        self._expire(now)
        decision = self.queue.admit(request, self._view(self.pool.get(rid).view()), 0)
        if decision.displaced is not None:
            self._refuse(decision.displaced, "displaced")
        if decision.verdict == "admit":
            return self._admit(request, blocks, now, waited=False)
        if decision.verdict == "reject":
            self.metrics.rejected.labels(decision.reason).inc()
            raise _overloaded(f"admission queue full ({self.cfg.max_queue} waiting)", decision.retry_after_s)
        self.metrics.queued.labels(request.priority).inc()
        return await self._wait(_Waiter(request, asyncio.get_running_loop().create_future(), blocks))

    def release(self, ticket: Ticket) -> None:
        """The request ended (any way): free its blocks, park its session's prefix, wake the queue."""
        self.ledger.release(ticket)
        if ticket.session_id is not None:
            self.sessions.touch(ticket.session_id, self.clock())
        self.pump()

    def on_scrape(self, started_at: float) -> None:
        """A scrape that began at ``started_at`` finished: it shows every request admitted before."""
        self.ledger.scraped_at = started_at
        for state in self.pool.states():
            if not state.healthy:
                self._drop(state.endpoint.replica_id)
        self.pump()
        self._publish()

    def pump(self) -> None:
        """Admit every queued request that fits now, in service order."""
        now = self.clock()
        self._expire(now)
        waiting = {r.session_id for r in self.queue.waiting() if r.session_id is not None}
        self.ledger.keep_live(self.sessions.live_sessions(now) | waiting)
        views = [self._view(s.view()) for s in self.pool.states()]
        views = [v if v.replica_id not in self.paused else replace(v, healthy=False) for v in views]
        for request in self.queue.pop_admissible(views, {}, now):
            waiter = self._waiters.pop(id(request), None)
            if waiter is None or waiter.future.done():
                continue  # its client went away
            waiter.future.set_result(self._admit(request, waiter.blocks, now, waited=True))
        self.metrics.queue_length.set(len(self.queue))

    def projected_usage(self, rid: ReplicaId) -> float | None:
        """Projected KV usage of ``rid`` (0..1), or None when its size is unknown."""
        view = self._view(self.pool.get(rid).view())
        return view.kv_cache_usage if view.num_gpu_blocks else None

    def check_integrity(self) -> None:
        self.queue.check_integrity()
        self.ledger.check_integrity()

    # -- internals ----------------------------------------------------------------------------

    def _request(self, rid: ReplicaId, total: int, matched: int, session_id: str | None, group_id: str | None,
                 now: float) -> tuple[AdmissionRequest, int]:
        """The queue's request (its ``new_blocks``: what it adds to the projection) and the
        blocks its ticket will hold."""
        live = session_id is not None and self.sessions.is_live(session_id, now)
        started = group_id is not None and self.groups.is_live(group_id, now)
        if live:
            self.sessions.touch(session_id, now)
        if group_id is not None:
            self.groups.touch(group_id, now)  # its later members are a started group's
        priority = classify(live, started)
        holds = total - min(matched, total) if priority == "group_member" else total
        counted = min(self.ledger.parked_of(session_id, rid), total) if session_id is not None else 0
        return AdmissionRequest(rid, max(0, holds - counted), priority, session_id, now), holds

    def _view(self, view: ReplicaView) -> ReplicaView:
        """``view`` with the router's projection as ``kv_cache_usage`` and its in-flight count."""
        rid, cap = view.replica_id, view.num_gpu_blocks
        count = self.ledger.count(rid)
        if not cap:
            return replace(view, in_flight=count)
        running = max(view.kv_cache_usage * cap + self.ledger.unseen(rid), self.ledger.committed(rid))
        return replace(view, in_flight=count, kv_cache_usage=(running + self.ledger.parked(rid)) / cap)

    def _admit(self, request: AdmissionRequest, blocks: int, now: float, *, waited: bool) -> Ticket:
        rid, sid = request.replica_id, request.session_id
        ticket = Ticket(rid, blocks, request.new_blocks, sid, now, request.priority, next(self._numbers))
        self.ledger.admit(ticket)
        if sid is not None:
            self.sessions.touch(sid, now)
        self.metrics.admitted.labels(rid, "yes" if waited else "no").inc()
        self.metrics.wait.observe(now - request.enqueued_at)
        return ticket

    async def _wait(self, waiter: _Waiter) -> Ticket:
        self._waiters[id(waiter.request)] = waiter
        self.metrics.queue_length.set(len(self.queue))
        deadline = waiter.request.enqueued_at + self.cfg.queue_timeout_s
        try:
            while True:
                left = max(deadline - self.clock(), 0.0) + 0.01
                try:
                    return await asyncio.wait_for(asyncio.shield(waiter.future), left)
                except asyncio.TimeoutError:
                    self._expire(self.clock())
        except asyncio.CancelledError:
            self._abandon(waiter)
            raise

    def _abandon(self, waiter: _Waiter) -> None:
        """The waiting client went away: give back a ticket it may just have been granted."""
        future = waiter.future
        if future.done() and not future.cancelled() and future.exception() is None:
            self.release(future.result())
        else:
            future.cancel()  # stays queued until popped or expired, then skipped

    def _expire(self, now: float) -> None:
        for request in self.queue.expire(now):
            self._fail(request, "timeout", _overloaded(
                f"waited {self.cfg.queue_timeout_s:g} s for KV cache room on {request.replica_id}",
                self.queue.retry_after_s(now)))

    def _refuse(self, request: AdmissionRequest, reason: str) -> None:
        self._fail(request, reason, _overloaded("pushed out of the admission queue by higher-priority work",
                                                self.queue.retry_after_s(self.clock())))

    def _drop(self, rid: ReplicaId) -> None:
        for request in self.queue.drop_replica(rid):
            self._fail(request, None, ReplicaGone(f"replica {rid} left rotation"))

    def _fail(self, request: AdmissionRequest, reason: str | None, exc: Exception) -> None:
        waiter = self._waiters.pop(id(request), None)
        if waiter is not None and not waiter.future.done():
            waiter.future.set_exception(exc)
            if reason is not None:
                self.metrics.rejected.labels(reason).inc()

    def _publish(self) -> None:
        for state in self.pool.states():
            rid = state.endpoint.replica_id
            usage = self.projected_usage(rid)
            if usage is not None:
                self.metrics.projected.labels(rid).set(usage)
            m = state.metrics
            self.metrics.parked.labels(rid).set(self.ledger.parked(rid))
            self.metrics.replica_requests.labels(rid, "running").set(m.num_running)
            self.metrics.replica_requests.labels(rid, "waiting").set(m.num_waiting)
            self.metrics.replica_preemptions.labels(rid).set(m.num_preemptions)


def _overloaded(message: str, retry_after_s: float | None) -> Overloaded:
    seconds = max(1, math.ceil(retry_after_s or 1))
    return Overloaded(f"router overloaded: {message}; retry after {seconds} s",
                      headers={"Retry-After": str(seconds)})
