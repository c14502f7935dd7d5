"""Prometheus metrics of one router, in its own registry (several routers may share a process)."""

from __future__ import annotations

import asyncio
import bisect
import time
from collections.abc import Callable, Container
from typing import TYPE_CHECKING

from aiohttp import web
import prometheus_client
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from router.auth import TENANT

if TYPE_CHECKING:
    from router.busy_poll import BusyPoll


class _CachedLabels:
    """``labels(*values)`` answered from a dict after the first call with those values: the
    request path asks for the same few children (per replica, per reason) on every request, and
    prometheus_client's own lookup (validation, ``str`` of each value, a lock) costs several
    times the ``inc`` it precedes. ``remove`` / ``clear`` forget the cached children too."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._children: dict[tuple, object] = {}

    def labels(self, *values, **kwargs):
        if kwargs:
            return super().labels(*values, **kwargs)
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = super().labels(*values)
        return child

    def remove(self, *values) -> None:
        self._children.clear()
        super().remove(*values)

    def remove_first(self, first: str) -> None:
        """Remove every child whose first label value is ``first`` (a replica that left)."""
        with self._lock:
            gone = [values for values in self._metrics if values[0] == first]
        for values in gone:
            self.remove(*values)

    def clear(self) -> None:
        self._children.clear()
        super().clear()


class _LoopValue:
    """A sample's value without prometheus_client's lock (``values.MutexValue``): a router's
    metrics are written and read (``generate_latest`` in its ``/metrics`` handler) on its event
    loop's thread only, where the lock is an acquire and a release per update for nothing. The
    request path updates about a dozen samples per request."""

    __slots__ = ("_value", "_exemplar")
    _multiprocess = False

    def __init__(self, *_args, **_kwargs) -> None:
        self._value = 0.0
        self._exemplar = None

    def inc(self, amount: float) -> None:
        self._value += amount

    def set(self, value: float, timestamp: float | None = None) -> None:
        self._value = value

    def set_exemplar(self, exemplar) -> None:
        self._exemplar = exemplar

    def get(self) -> float:
        return self._value

    def get_exemplar(self):
        return self._exemplar


class Counter(_CachedLabels, prometheus_client.Counter):
    """prometheus_client's Counter on :class:`_LoopValue`; ``inc`` of a sample in one step."""

    def _metric_init(self) -> None:
        super()._metric_init()
        self._value = _LoopValue()

    def inc(self, amount: float = 1, exemplar=None) -> None:
        if amount >= 0 and not exemplar:
            try:
                self._value._value += amount
                return
            except AttributeError:  # a parent with labels: prometheus_client's error
                pass
        super().inc(amount, exemplar)


class Gauge(_CachedLabels, prometheus_client.Gauge):
    """prometheus_client's Gauge on :class:`_LoopValue`; ``set`` of a sample in one step."""

    def _metric_init(self) -> None:
        super()._metric_init()
        self._value = _LoopValue()

    def set(self, value: float) -> None:
        try:
            self._value._value = float(value)
        except AttributeError:  # a parent with labels: prometheus_client's error
            super().set(value)


class Histogram(_CachedLabels, prometheus_client.Histogram):
    """prometheus_client's Histogram on :class:`_LoopValue`; ``observe`` finds its bucket by
    bisection (``le`` holds ``amount <= bound``: the first bound not below it)."""

    def _metric_init(self) -> None:
        super()._metric_init()
        self._sum = _LoopValue()
        self._buckets = [_LoopValue() for _ in self._upper_bounds]

    def observe(self, amount: float, exemplar=None) -> None:
        if not exemplar and amount == amount:  # NaN counts in no bucket, as prometheus_client's loop does
            try:
                self._sum._value += amount
                self._buckets[bisect.bisect_left(self._upper_bounds, amount)]._value += 1
                return
            except AttributeError:  # a parent with labels: prometheus_client's error
                pass
        super().observe(amount, exemplar)


class RouterMetrics:
    """Counters and gauges named ``rollout_router_*``.

    ``replicas``: the replicas in the fleet now (the decision core's records: ``create_app`` sets
    it); a per-replica gauge is set only for one of them, so work that ends after its replica
    left (a request, a scrape in flight) does not bring back the gauges ``forget_replica``
    removed. None: every replica counts."""

    def __init__(self) -> None:
        self.replicas: Container[str] | None = None
        self.before_scrape: list[Callable[[], None]] = []
        """Called before each ``/metrics`` answer: counters kept up to date lazily bring
        themselves up to date (``router.busy_poll.BusyPoll.count_now``)."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("rollout_router_requests", "Requests handled, by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.busy_poll = Counter("rollout_router_busy_poll_seconds", "Seconds the event loop polled without "
                                 "sleeping after requests (router.busy_poll_ms)", registry=r)
        self.decisions = Counter("rollout_router_routing_decisions", "Routing decisions, by policy and reason",
                                 ["policy", "reason"], registry=r)
        self.prompt_tokens = Counter("rollout_router_prompt_tokens", "Prompt tokens sent, by replica",
                                     ["replica"], registry=r)
        self.predicted_cached = Counter("rollout_router_predicted_cached_tokens",
                                        "Prefix tokens the router expected to be cached, by replica, on the "
                                        "requests whose answer reported its cached tokens (as reported_cached)",
                                        ["replica"], registry=r)
        self.reported_cached = Counter("rollout_router_reported_cached_tokens",
                                       "Cached prompt tokens the replica reported (usage.prompt_tokens_details)",
                                       ["replica"], registry=r)
        self.in_flight = Gauge("rollout_router_in_flight", "Requests in flight, by replica", ["replica"], registry=r)
        self.retries = Counter("rollout_router_retries", "Requests run again, by reason: unreachable, failed (a 5xx "
                               "or a broken answer), abandoned (its replica found stalled or hung), weight_update",
                               ["reason"], registry=r)
        self.kv_usage = Gauge("rollout_router_replica_kv_cache_usage",
                              "KV cache usage (0..1) last scraped from the replica", ["replica"], registry=r)
        self.healthy = Gauge("rollout_router_replica_healthy", "1 if the replica is in rotation", ["replica"],
                             registry=r)
        self.stalls = Counter("rollout_router_replica_stalls", "Stalls of a replica's engine (it held requests, "
                              "or the router's probe, and finished no token for policy.stall_timeout_s), each "
                              "one, also those in a row while it is out (/health's stalls: the run now)",
                              ["replica"], registry=r)
        self.probes = Counter("rollout_router_replica_probes", "Probes of idle engines (a one-token completion "
                              "after policy.stall_probe_after_s without a finished token), by outcome: ok, "
                              "refused (an HTTP error), failed (no connection), timeout, cancelled (its replica restarted or "
                              "removed, or the router stopped, while it was in flight)", ["replica", "outcome"],
                              registry=r)
        self.latency = Histogram("rollout_router_request_seconds", "End-to-end request latency, by endpoint",
                                 ["endpoint"], registry=r,
                                 buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))

        self.hit_rate = Gauge("rollout_router_prefix_cache_hit_rate", "Cached prompt tokens / prompt tokens the "
                              "replica reported over this router's requests (0..1), by replica", ["replica"], registry=r)
        self.saved = Counter("rollout_router_prefill_tokens_saved", "Prompt tokens the replica did not prefill "
                             "(reported cached), by replica", ["replica"], registry=r)
        self.admission_admitted = Counter("rollout_router_admission_admitted", "Requests admitted, by replica and "
                                          "whether they waited", ["replica", "waited"], registry=r)
        self.admission_queued = Counter("rollout_router_admission_queued", "Requests that had to wait, by priority",
                                        ["priority"], registry=r)
        self.admission_rejected = Counter("rollout_router_admission_rejected", "Requests refused with 429, by "
                                          "reason (queue_full, timeout, displaced)", ["reason"], registry=r)
        self.admission_wait = Histogram("rollout_router_admission_queue_wait_seconds", "Time queued requests "
                                        "waited", registry=r, buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60))
        self.admission_queue_length = Gauge("rollout_router_admission_queue_length", "Requests waiting", registry=r)
        self.projected = Gauge("rollout_router_admission_projected_kv_usage", "KV usage (0..1) the router projects: "
                               "running, reserved and parked blocks (the scraped value is "
                               "rollout_router_replica_kv_cache_usage)", ["replica"], registry=r)
        self.parked = Gauge("rollout_router_admission_parked_blocks", "Blocks of live sessions between turns",
                            ["replica"], registry=r)
        self.replica_requests = Gauge("rollout_router_replica_requests", "Requests the replica reported in its last "
                                      "scrape, by state (running, waiting)", ["replica", "state"], registry=r)
        self.replica_preemptions = Gauge("rollout_router_replica_preemptions", "The replica's own preemption count "
                                         "(vllm:num_preemptions_total) at its last scrape", ["replica"], registry=r)
        self.kv_index = Gauge("rollout_router_kv_index", "The prefix index: entries, predicted, confirmed, "
                              "expired (predictions no KV event confirmed in time)", ["name"], registry=r)
        self.kv_events = Gauge("rollout_router_kv_events", "KV events from each replica: batches, gaps, "
                               "gaps_repaired, gaps_lost, garbage, restarts, lag_s, events, stored, removed, "
                               "unmapped, resets", ["replica", "name"], registry=r)
        self.state = Gauge("rollout_router_state_entries", "Entries each part of the router's state holds "
                           "(DecisionCore.state_sizes and the lifecycle's flights, waiters, reruns): what must "
                           "stay bounded in a router left running for days (bench.soak)", ["part"], registry=r)
        self._prompt: dict[str, int] = {}
        self._cached: dict[str, int] = {}

    def count_request(self, endpoint: str, status: str, seconds: float) -> None:
        """One request to ``endpoint`` (a label of :data:`ENDPOINT_PATHS`) ended with HTTP
        ``status`` (``"499"``: its client left) after ``seconds``: the metrics middleware counts
        every request it sees, ``router.fastlane`` those it ends before the middlewares run."""
        self.latency.labels(endpoint).observe(seconds)
        self.requests.labels(endpoint, status).inc()

    def count_prompt(self, job, prompt_tokens: int, reported_cached: int | None) -> None:
        """A replica accepted ``job``: ``prompt_tokens`` it was sent (a completion's prompt once,
        whatever ``n``, as vLLM's usage counts it; a scoring fan-out's every context + response),
        the router's predicted cached tokens for them, and the cached tokens it reported. Predicted
        and reported count the same requests: a stream without ``include_usage`` or one its client
        left reports nothing, and counting its prediction alone read as over-prediction (a fresh
        user saw 2,720 predicted vs 1,760 reported on one replica). A reported count below zero is
        none, one past ``prompt_tokens`` counts as ``prompt_tokens``."""
        rid = str(job.replica_id)
        self.prompt_tokens.labels(rid).inc(prompt_tokens)
        if reported_cached is None or reported_cached < 0:
            return
        reported_cached = min(reported_cached, prompt_tokens)  # a replica's count past its prompt is no hit
        samples = max(1, prompt_tokens // max(1, job.view.num_prompt_tokens))
        self.predicted_cached.labels(rid).inc(job.expected_cached_tokens * samples)
        self.reported_cached.labels(rid).inc(reported_cached)
        self.saved.labels(rid).inc(reported_cached)
        if not self.live(rid):
            return
        self._prompt[rid] = self._prompt.get(rid, 0) + prompt_tokens
        self._cached[rid] = self._cached.get(rid, 0) + reported_cached
        self.hit_rate.labels(rid).set(self._cached[rid] / max(1, self._prompt[rid]))

    def publish_replicas(self, core, pool) -> None:
        """Per-replica gauges after a scrape: projected usage, parked blocks, the replica's own counts."""
        for state in pool.states():
            rid = state.endpoint.replica_id
            if rid not in core.replicas:
                continue
            view = core.replica_view(rid)
            if view.num_gpu_blocks:
                self.projected.labels(rid).set(view.kv_cache_usage)
            self.parked.labels(rid).set(core.registry.parked_blocks(rid))
            m = state.metrics
            self.replica_requests.labels(rid, "running").set(m.num_running)
            self.replica_requests.labels(rid, "waiting").set(m.num_waiting)
            self.replica_preemptions.labels(rid).set(m.num_preemptions)

    def live(self, rid: str) -> bool:
        """Whether ``rid`` is in the fleet (see ``replicas``): its gauges may be set."""
        return self.replicas is None or rid in self.replicas

    def set_in_flight(self, rid: str, n: int) -> None:
        """``rollout_router_in_flight`` of ``rid``, unless it left the fleet."""
        if self.live(rid):
            self.in_flight.labels(rid).set(n)

    def forget_replica(self, rid: str) -> None:
        """``rid`` left the fleet: its gauges go (a dashboard would read its last in-flight count,
        KV usage and hit rate forever); ``rollout_router_replica_healthy`` stays at 0 and its counters
        keep their totals (a series that ends is what Prometheus expects of a removed target)."""
        for gauge in (self.in_flight, self.kv_usage, self.hit_rate, self.projected, self.parked, self.replica_requests,
                      self.replica_preemptions, self.kv_events):
            gauge.remove_first(rid)
        self._prompt.pop(rid, None)
        self._cached.pop(rid, None)

    def publish_state(self, sizes: dict[str, int]) -> None:
        """``rollout_router_state_entries`` by part, after a scrape round (``DecisionCore.state_sizes``
        with ``Lifecycle.state_sizes``)."""
        for part, n in sizes.items():
            self.state.labels(part).set(n)

    def publish_kv_events(self, snapshot: dict[str, float]) -> None:
        """The KV-event subscriber's counters (``KvEventSubscriber.snapshot``) as gauges."""
        for key, value in snapshot.items():
            rid, _, name = key.rpartition(":")
            if rid:
                self.kv_events.labels(rid, name).set(value)
            else:
                self.kv_index.labels(name).set(value)

    async def handle(self, request: web.Request) -> web.Response:
        """GET /metrics in the Prometheus text format (``before_scrape`` run first)."""
        for bring_up_to_date in self.before_scrape:
            bring_up_to_date()
        resp = web.Response(body=generate_latest(self.registry))
        resp.content_type = CONTENT_TYPE_LATEST.split(";")[0]
        return resp


ENDPOINT_PATHS = {"/v1/completions": "completions", "/v1/chat/completions": "chat", "/v1/score": "score"}
"""Request paths counted in ``rollout_router_requests_total`` / ``_request_seconds``, by label."""


def metrics_middleware(metrics: RouterMetrics, busy_poll: BusyPoll | None = None):
    """Count every request to :data:`ENDPOINT_PATHS` by endpoint and final HTTP status, the
    router's own 4xx included, and observe its latency. Must sit outside ``error_middleware`` so
    errors arrive as responses; a client that goes away counts as 499, anything unhandled as 500.
    ``busy_poll``: kicked as each of those requests ends (``router.busy_poll``; the fast lane's
    pass here too) once the edge took its API key (``router.auth.TENANT`` set): not by scrapes,
    health checks or a refused key (an attacker without a key kept a core busy so)."""
    kick = busy_poll.kick if busy_poll is not None else None

    @web.middleware
    async def count(request: web.Request, handler):
        endpoint = ENDPOINT_PATHS.get(request.path)
        if endpoint is None:
            return await handler(request)
        started = time.perf_counter()
        status = "500"
        try:
            resp = await handler(request)
            status = str(resp.status)
            return resp
        except asyncio.CancelledError:
            status = "499"
            raise
        finally:
            metrics.count_request(endpoint, status, time.perf_counter() - started)
            if kick is not None and TENANT in request:
                kick()

    return count
