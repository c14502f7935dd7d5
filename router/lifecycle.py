"""One request's life in the router, for completions, chat and scoring alike.

    parse (handlers / score) -> RequestSpec
      -> core.open -> core.place -> core.admit (wait on a future while queued)   [decide]
      -> attempt(job, endpoint)                                                   [carry out]
           ReplicaUnreachable: core.finish(unreachable) marks it unhealthy; place again
           RetryElsewhere:     core.finish(failed) on that replica; place again
           Rerun / preempted:  core.finish(preempted); place again (a weight update took it back
                               before anything reached the client, or its replica's version
                               changed while it ran: router.weights, README "Version contract")
      -> core.finish(job, outcome)                                                [release]

The decision core (``cache_policy.core``) decides everything; this module only waits, sends
and counts. A retry happens only while nothing reached the client, within
``router.connect_retries`` extra attempts. A client that goes away while its request waits in
admission leaves the queue at once (``finish(cancelled)``), and nothing it never prefilled
stays in the prefix index or the pin table.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp

from cache_policy.admission_state import Admission
from cache_policy.core import DecisionCore, Job, Outcome, RequestSpec
from cache_policy.types import ReplicaId
from replicas.replica_set import ReplicaEndpoint
from router.config import RouterConfig
from router.errors import NoReplica, Overloaded, RouterError, UpstreamError
from router.metrics import RouterMetrics
from router.pool import ReplicaPool
from router.upstream import ReplicaClient, ReplicaUnreachable
from router.weights.report import first_span, next_span

log = logging.getLogger(__name__)

T = TypeVar("T")
SHUTDOWN_RETRY_AFTER_S = 5
"""What a request refused by a stopping router is told to wait (``router.shutdown``)."""
QUIET_S, QUIET_MAX_S, QUIET_POLL_S = 0.1, 2.0, 0.025
"""A kept stream's token count must stand still this long (at most the second) before its span ends."""
Attempt = Callable[[Job, ReplicaEndpoint], Awaitable[T]]
MAX_ABORT_RERUNS = 3
"""Times one request runs again after its engine aborted it (``Lifecycle.aborted``)."""
ENDED_REASON_CHARS = 300
"""How much of the reason a stream ended by ``Lifecycle.left_paused`` says in its error event (an
update's error holds vLLM's load and restore errors, over 1,000 characters)."""
MAX_ABANDONS = 3
"""Times one request runs again elsewhere after its replica was found stalled or hung."""


class RetryElsewhere(Exception):
    """The replica failed the request before anything reached the client; it stays in rotation
    (a scoring batch with an incomplete row, a 5xx): run the whole request on another replica."""


class Abandoned(RetryElsewhere):
    """Taken back from a replica a rule took out of rotation (its engine stalled, or it stopped
    answering: ``Lifecycle.abandon``) before anything reached the client: run it on another
    replica. Not a failure of the request nor of the replica (already counted out), so it does
    not use up ``router.connect_retries``; at most :data:`MAX_ABANDONS` times per request."""


class Rerun(Exception):
    """The job must run again whole, on any replica (the same one included), no failure counted:
    its replica's weights changed while it ran and nothing reached the client."""


class Stale(RouterError):
    """The request's ``weight_version`` is more than ``router.max_staleness`` behind (409)."""

    status = 409


@dataclass(eq=False)
class Flight:
    """One dispatched attempt, as a weight update sees it (``Lifecycle.flights``).

    ``streaming``: its answer streams to the client (once answering, it is kept across an
    update, never preempted; before its first token it is taken back like any); ``task``: the
    request's own task, running the attempt (``preempt`` cancels it, ``_fly`` takes the cancel
    back; None once the attempt returned); ``tokens``: tokens relayed so far per choice index
    (streams); ``spans``: the versions its tokens were computed under
    (``router.responses.span``), the last one current."""

    job: Job
    streaming: bool
    task: asyncio.Task | None = None
    preempted: str | None = None
    elsewhere: bool = False
    """Taken back because its replica stopped answering (``Lifecycle.abandon``): it runs again
    on another replica, as after a 5xx, instead of again on any (a weight update's preemption)."""
    tokens: dict[int, int] = field(default_factory=dict)
    spans: list[dict[str, Any]] = field(default_factory=list)
    watch: Any = None
    """A stream's relay (``router.weights.report.StreamWatch``): :meth:`Lifecycle.left_paused`
    ends it through this."""

    @property
    def answering(self) -> bool:
        """Its answer is being written to the client (``Lifecycle.answer_starts``: a JSON answer
        read whole, a stream once its first byte went; the core's ``Job.answering``): a weight
        update or an abandon leaves it alone (preempting it now would answer twice)."""
        return self.job.answering > 0


class Lifecycle:
    """Carries out the core's decisions for one router app. Event-loop only.

    ``status(result)`` tells how an attempt's result ended: an HTTP status (4xx: the replica
    refused it and prefilled nothing).
    """

    def __init__(self, cfg: RouterConfig, core: DecisionCore, pool: ReplicaPool, metrics: RouterMetrics,
                 http: aiohttp.ClientSession, *, clock: Callable[[], float] = time.monotonic,
                 shared: Any = None, upstream: ReplicaClient) -> None:
        self.cfg = cfg
        self.core = core
        self.pool = pool
        self.metrics = metrics
        self.http = http
        """Streams and everything else to replicas (aiohttp)."""
        self.upstream = upstream
        """Non-streamed completions and scoring rows (``router.upstream``: the lean client)."""
        self.clock = clock
        self.shared = shared
        self.queue_timeout_s = core.cfg.queue_timeout_s
        self._waiters: dict[int, asyncio.Future[Admission]] = {}
        self._rotation_changed = asyncio.Event()
        self.flights: dict[ReplicaId, dict[int, Flight]] = {}
        """Dispatched attempts per replica (what a weight update drains, preempts or marks)."""
        self.reruns: dict[int, int] = {}
        """Per job id, how many times a weight update made it run again (reported in its answer)."""
        self._background: set[asyncio.Task] = set()
        """Sessions' ends on their way to shared state (referenced until done)."""

    async def run(self, spec: RequestSpec, attempt: Attempt[T], status: Callable[[T], int],
                  failed: Callable[[T], Outcome | None] = lambda _: None, *, streaming: bool = False) -> T:
        """Open, place, admit and run ``attempt`` until it succeeds, is refused, or retries run out.

        ``streaming``: the attempt relays a stream (kept across weight updates once its first
        token went, never re-run from then on). ``failed(result)``: the outcome of a result that
        answered 2xx but ended badly (a stream ended by an error event: ``failed``, or ``ended``
        by the router), else None.
        Raises Stale (409), NoReplica (503), Overloaded (429), UpstreamError (502) or the attempt's own errors.
        """
        if self.core.too_stale(spec.weight_version, getattr(self.cfg, "max_staleness", None)):
            raise Stale(f"weight_version {spec.weight_version} is older than the current version "
                        f"{self.core.versions.current} by more than router.max_staleness="
                        f"{self.cfg.max_staleness}", param="weight_version")
        # shared state (router.state): versions confirmed and the request's pins adopted before
        # open chooses its salt; after placing, its pins are claimed (first writer wins)
        seen = await self.shared.before_open(self.core, spec) if self.shared is not None else None
        job = self.core.open(spec, self.clock())
        outcome: Outcome = "failed"
        try:
            while True:
                await self._place(job, seen)
                if not await self._admit(job):
                    continue  # its replica left while it waited: place it again
                if not self._dispatched(job):  # an update began while it waited on shared state
                    self._finish(job, "preempted")
                    continue
                try:
                    result = await self._fly(job, attempt, streaming)
                except (ReplicaUnreachable, RetryElsewhere) as exc:
                    self._retry(job, exc)
                    continue
                except Rerun as exc:
                    self._rerun(job, str(exc))
                    continue
                code = status(result)
                outcome = "refused" if 400 <= code < 500 else "ok" if code < 400 else "failed"
                if outcome == "ok":  # a stream its replica broke, or the router ended, after it started
                    outcome = failed(result) or "ok"
                return result
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except RouterError as exc:  # a replica's 4xx raised by the attempt: it prefilled nothing
            outcome = "refused" if 400 <= exc.status < 500 else "failed"
            raise
        finally:
            self.reruns.pop(job.id, None)
            self._finish(job, outcome)
            if outcome == "ok" and spec.ends_session and spec.session_id is not None:
                self._end_shared(spec.session_id)

    async def _fly(self, job: Job, attempt: Attempt[T], streaming: bool) -> T:
        """Run ``attempt`` in this task, which a weight update may cancel to take it back
        (``preempt``): then Rerun. No task of its own: a task per attempt cost a loop turn and
        its bookkeeping on every request's critical path (``bench.h2h.ab``)."""
        rid = job.decision.replica_id
        task = asyncio.current_task()
        assert task is not None, "bug: _fly() outside a task"
        flight = Flight(job, streaming, task=task, spans=[first_span(self.core, job)])
        # after the attempt's first step (it sends the request, then waits for the answer): the
        # placement's deferred bookkeeping runs while the replica works, not before the send
        asyncio.get_running_loop().call_soon(self.core.settle)
        self.flights.setdefault(rid, {})[job.id] = flight
        try:
            return await attempt(job, self.pool.get(rid).endpoint)
        except asyncio.CancelledError:
            # preempted alone (the client still here): take the cancel back and run it again;
            # a client gone as well (two cancels) ends the request
            if flight.preempted is not None and task.uncancel() == 0:
                if flight.elsewhere:
                    raise Abandoned(flight.preempted) from None
                raise Rerun(flight.preempted) from None
            raise
        finally:
            flight.task = None  # a preemption from now on would hit whatever the task does next
            held = self.flights.get(rid)
            if held is not None:  # a replica's entry goes with its last flight (replicas come and go)
                held.pop(job.id, None)
                if not held:
                    del self.flights[rid]

    def _end_shared(self, session_id: str) -> None:
        """The session's last turn ended (``X-Session-End``; the core ended it here): end it in
        shared state too, off the answer's path (``shared.end_session`` never raises)."""
        if self.shared is None:
            return
        task = asyncio.get_running_loop().create_task(self.shared.end_session(session_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def mark_new_spans(self, rid: ReplicaId, version: int, recomputed: bool) -> None:
        """Kept streams on ``rid`` enter a span of ``version`` from the tokens counted so far (the
        router running the update, and every other router once it applies that version: its
        engine is still paused then, ``router.weights.steps``). Once each stream's count has stood
        still for ``QUIET_S`` every token it made before the pause has been read
        (``router.weights.stream`` reads ahead of the client). ``recomputed``: the update's reset
        preempted them, so they recompute their context under ``version`` (not hybrid)."""
        streams = [f for f in self.flights.get(rid, {}).values() if f.streaming]
        deadline, last, since = time.monotonic() + QUIET_MAX_S, None, time.monotonic()
        while streams and time.monotonic() < deadline:
            counts = [dict(f.tokens) for f in streams]
            if counts != last:
                last, since = counts, time.monotonic()
            elif time.monotonic() - since >= QUIET_S:
                break
            await asyncio.sleep(QUIET_POLL_S)
        for flight in self.flights.get(rid, {}).values():  # one not answering runs again (answer_starts)
            if flight.streaming and flight.answering and flight.spans and flight.spans[-1]["weight_version"] != version:
                flight.spans.append(next_span(flight.spans, flight.tokens, version, recomputed))

    def state_sizes(self) -> dict[str, int]:
        """Entries the lifecycle holds (0 once nothing is in flight): ``flights`` (attempts
        dispatched), ``waiters`` (requests waiting in admission), ``reruns`` (requests a weight
        update made run again, until they end)."""
        return {"flights": sum(map(len, self.flights.values())), "waiters": len(self._waiters),
                "reruns": len(self.reruns)}

    def flight(self, job: Job) -> Flight | None:
        """The dispatched attempt of ``job``, if any."""
        return self.flights.get(job.replica_id, {}).get(job.id)

    def answer_starts(self, job: Job, aborted: bool = False) -> None:
        """The first byte of ``job``'s answer is about to reach its client: the last moment it can
        run again. Raises Rerun when its replica's version moved since its dispatch (the answer
        would mix versions: a non-streamed answer, a scoring fan-out above all, is never mixed) or
        when the engine aborted it part way or before its first token (``aborted``: it would be
        partial, :meth:`aborted`); else marks its flight answering, and a weight update or an
        abandon leaves it alone from now on. Streams call it at their first token
        (``router.weights.stream``), JSON answers once read whole (``AnswerAhead`` included)."""
        if self.versions_moved(job):
            # from the version it was dispatched under (a long-cut log's first kept entry is later)
            now = self.core.versions_since(job)[-1]
            raise Rerun(f"replica {job.replica_id} moved from version {job.weight_version} to {now} while the request ran")
        if aborted:
            raise self.aborted(job)
        self.core.answering(job)

    def aborted(self, job: Job) -> Exception:
        """What to raise for ``job``'s non-streamed answer its engine aborted part way (a choice's
        ``finish_reason: "abort"``): Rerun (whole, on any replica, no failure counted: a weight
        update under ``pause_mode: abort``, run by this router or another, takes work back this
        way), at most :data:`MAX_ABORT_RERUNS` times; then RetryElsewhere (a replica that aborts
        everything fails like one that answers 5xx)."""
        rid = job.replica_id
        if self.reruns.get(job.id, 0) < MAX_ABORT_RERUNS:
            return Rerun(f"replica {rid} aborted the request part way (a weight update paused it?)")
        return RetryElsewhere(f"replica {rid} aborted the request part way, again")

    def versions_moved(self, job: Job) -> bool:
        """Whether ``job``'s replica served more than one version since its dispatch."""
        return len(self.core.versions_since(job)) > 1

    def preempt(self, rid: ReplicaId, reason: str) -> int:
        """Take back every attempt on ``rid`` of which nothing reached the client yet, streams
        before their first token included (they run again whole); the count. The streams left
        are in the engine (they made a token), so ``/pause`` keeps or aborts every one of them."""
        n = 0
        for flight in list(self.flights.get(rid, {}).values()):
            if not flight.answering and flight.task is not None and flight.preempted is None:
                flight.preempted = reason
                flight.task.cancel()
                n += 1
        return n

    def abandon(self, rid: ReplicaId, reason: str) -> int:
        """``rid`` stopped answering (out of rotation: a failed health check or scrapes, a restart,
        a removal): take back every attempt there of which nothing reached the client yet, streams
        included, to run on another replica (``RetryElsewhere``, within ``connect_retries``)
        instead of waiting ``request_timeout_s`` on a hung engine for a 502. Returns the count."""
        n = 0
        for flight in list(self.flights.get(rid, {}).values()):
            if not flight.answering and flight.task is not None and flight.preempted is None:
                flight.preempted, flight.elsewhere = reason, True
                flight.task.cancel()
                n += 1
        if n:
            log.warning("replica %s: %d request(s) in flight there run again elsewhere: %s", rid, n, reason)
        return n

    def left_paused(self, rid: ReplicaId, reason: str) -> int:
        """A weight update left ``rid`` paused (``cache_policy.sharing.left_paused``: its weights
        undefined, its resume failed or its engine hangs; run by this router or, read from shared
        state, by another): nothing there runs on until a later update resumes it. Attempts of
        which nothing reached the client run again elsewhere (:meth:`abandon`); streams already
        answering end now with an error event saying ``reason`` (``StreamWatch.end``) instead of
        waiting ``router.request_timeout_s`` for tokens that never come. Returns the streams ended."""
        self.abandon(rid, reason)
        said = reason if len(reason) <= ENDED_REASON_CHARS else \
            reason[:ENDED_REASON_CHARS] + "... (GET /admin/weights and /health give the whole reason)"
        ended = sum(1 for flight in list(self.flights.get(rid, {}).values())
                    if flight.streaming and flight.answering and flight.watch is not None and flight.watch.end(said))
        if ended:
            log.warning("replica %s: %d stream(s) answering there end with an error event: %s", rid, ended, reason)
        return ended

    def _rerun(self, job: Job, reason: str) -> None:
        rid = job.replica_id
        log.info("job %s on %s runs again: %s", job.id, rid, reason)
        self.reruns[job.id] = self.reruns.get(job.id, 0) + 1
        self.metrics.retries.labels("weight_update").inc()
        self.core.finish(job, "preempted", self.clock())
        self._after_finish(rid)

    # -- decide --------------------------------------------------------------------------------

    async def _place(self, job: Job, seen: Any = None) -> None:
        """Place ``job``, waiting (up to ``queue_timeout_s``) while a weight update holds replicas;
        with shared state, move it to another router's winning pin before it is admitted."""
        deadline = self.clock() + self.queue_timeout_s
        while True:
            decision = self.core.place(job, self.clock())
            if decision is not None:
                self.metrics.decisions.labels(self.core.policy.name, decision.reason.value).inc()
                if self.shared is not None:
                    await self.shared.after_place(self.core, job, seen, self.clock())
                return
            left = deadline - self.clock()
            if not self.core.versions.updating() or left <= 0:
                raise NoReplica("no healthy replica can take the request; retry later", headers={"Retry-After": "1"})
            await self.wait_rotation(left)

    async def _admit(self, job: Job) -> bool:
        """Admit ``job`` or wait in the queue; False when its replica left (place it again)."""
        adm = self.core.admit(job, self.clock())
        if adm.verdict == "queue":
            self.metrics.admission_queued.labels(job.queued.priority).inc()
            adm = await self._wait(job)  # it pumps once its waiter is set: the pump may admit it at once
        elif self.core.has_decisions():  # nothing queued (most requests): no pump (finish's runs the sweep)
            self._deliver(self.core.pump(self.clock()))
        if adm.verdict == "reject":
            self.metrics.admission_rejected.labels(adm.reason).inc()
            if adm.reason == "shutdown":
                raise NoReplica("the router is shutting down; retry on another router or later",
                                headers={"Retry-After": str(SHUTDOWN_RETRY_AFTER_S)})
            raise _overloaded(adm)
        if adm.verdict == "replica_gone":
            return False
        self.metrics.admission_admitted.labels(job.decision.replica_id, "yes" if adm.waited else "no").inc()
        return True

    async def _wait(self, job: Job) -> Admission:
        future: asyncio.Future[Admission] = asyncio.get_running_loop().create_future()
        self._waiters[job.id] = future
        self._deliver(self.core.pump(self.clock()))  # after the waiter is set, so its own decision reaches it
        started = self.clock()
        try:
            while not future.done():
                left = started + self.queue_timeout_s - self.clock()
                try:  # asyncio.timeout: 3.11's wait_for can swallow a cancel that races the result
                    async with asyncio.timeout(max(left, 0.0) + 0.01):
                        await asyncio.shield(future)
                except TimeoutError:
                    self._deliver(self.core.pump(self.clock()))  # expires it when its time is up
            adm = future.result()
            self.metrics.admission_wait.observe(self.clock() - started)
            return adm
        finally:
            self._waiters.pop(job.id, None)

    def refuse_queued(self) -> None:
        """The router is stopping (``router.shutdown`` hook): every queued request is answered
        503 with Retry-After at once; in-flight ones run on."""
        self.core.refuse_queued("shutdown", self.clock())
        self.pump()

    def pump(self) -> None:
        """Admit what fits now (after a scrape, a finish or a replica event)."""
        self._deliver(self.core.pump(self.clock()))

    def _deliver(self, decided: list[tuple[Job, Admission]]) -> None:
        for job, adm in decided:
            future = self._waiters.get(job.id)
            if future is not None and not future.done():
                future.set_result(adm)
            elif adm.verdict == "admit":  # its client is gone: give the room back
                self.core.finish(job, "cancelled", self.clock())
        self.metrics.admission_queue_length.set(self.core.queue_length())

    # -- carry out and release -----------------------------------------------------------------

    def _dispatched(self, job: Job) -> bool:
        """Count ``job`` as sent; False when it may not be sent now (``core.dispatchable``)."""
        rid = job.decision.replica_id
        self.metrics.set_in_flight(rid, self.core.in_flight(rid))
        return self.core.dispatchable(job)

    def _retry(self, job: Job, exc: Exception) -> None:
        """Release ``job`` from the replica that failed it (or was found stalled or hung:
        :class:`Abandoned`, logged by :meth:`abandon`); raise UpstreamError when retries ran out
        (``router.connect_retries``, and :data:`MAX_ABANDONS` apart)."""
        rid = job.decision.replica_id
        unreachable, abandoned = isinstance(exc, ReplicaUnreachable), isinstance(exc, Abandoned)
        if unreachable:
            outcome: Outcome = "down" if exc.refused else "unreachable"
            if exc.refused and rid in self.pool:  # nothing listens: the server that answers next is a new one
                self.pool.get(rid).gone = True
        else:
            outcome = "abandoned" if abandoned else "retry"
        if not abandoned:
            log.warning("replica %s %s: %s", rid, "unreachable" if unreachable else "failed the request", exc)
        self.core.finish(job, outcome, self.clock())
        self._after_finish(rid)
        if len(job.tried) - job.abandoned > self.cfg.connect_retries or job.abandoned > MAX_ABANDONS:
            raise UpstreamError(f"replica {rid} {'unreachable' if unreachable else 'failed'} and retries "
                                f"exhausted: {exc}") from exc
        self.metrics.retries.labels("unreachable" if unreachable else "abandoned" if abandoned else "failed").inc()

    def _finish(self, job: Job, outcome: Outcome) -> None:
        rid = job.replica_id
        self.core.finish(job, outcome, self.clock())
        self._after_finish(rid)

    def _after_finish(self, rid) -> None:
        if rid is not None:
            self.metrics.set_in_flight(rid, self.core.in_flight(rid))
        for out, outcome, failures in self.core.taken_out():
            log.warning("replica %s unhealthy: %d failed request(s) in a row (last: %s); no request is sent "
                        "there until a scrape reaches it", out, failures, outcome)
            self.metrics.healthy.labels(out).set(0)
        self.pump()

    # -- rotation --------------------------------------------------------------------------------

    def rotation_changed(self) -> None:
        """An update step ended or a replica came back: wake placements waiting for one."""
        self._rotation_changed.set()
        self.pump()

    async def wait_rotation(self, timeout_s: float) -> bool:
        """Wait until the rotation changes; False on timeout."""
        self._rotation_changed.clear()
        try:
            async with asyncio.timeout(timeout_s):
                await self._rotation_changed.wait()
        except TimeoutError:
            return False
        return True


def _overloaded(adm: Admission) -> Overloaded:
    seconds = max(1, math.ceil(adm.retry_after_s or 1))
    what = {"queue_full": "admission queue full", "timeout": "waited too long for KV cache room",
            "displaced": "pushed out of the admission queue by higher-priority work"}.get(adm.reason, adm.reason)
    return Overloaded(f"router overloaded: {what}; retry after {seconds} s", headers={"Retry-After": str(seconds)})
