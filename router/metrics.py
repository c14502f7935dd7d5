"""Prometheus metrics of one router, in its own registry (several routers may share a process)."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST


class RouterMetrics:
    """Counters and gauges named ``rollout_router_*``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("rollout_router_requests", "Requests handled, by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.decisions = Counter("rollout_router_routing_decisions", "Routing decisions, by policy and reason",
                                 ["policy", "reason"], registry=r)
        self.prompt_tokens = Counter("rollout_router_prompt_tokens", "Prompt tokens sent, by replica",
                                     ["replica"], registry=r)
        self.predicted_cached = Counter("rollout_router_predicted_cached_tokens",
                                        "Prefix tokens the router expected to be cached, by replica",
                                        ["replica"], registry=r)
        self.reported_cached = Counter("rollout_router_reported_cached_tokens",
                                       "Cached prompt tokens the replica reported (usage.prompt_tokens_details)",
                                       ["replica"], registry=r)
        self.in_flight = Gauge("rollout_router_in_flight", "Requests in flight, by replica", ["replica"], registry=r)
        self.retries = Counter("rollout_router_retries", "Requests retried on another replica, by reason",
                               ["reason"], registry=r)
        self.kv_usage = Gauge("rollout_router_replica_kv_cache_usage",
                              "KV cache usage (0..1) last scraped from the replica", ["replica"], registry=r)
        self.healthy = Gauge("rollout_router_replica_healthy", "1 if the replica is in rotation", ["replica"],
                             registry=r)
        self.latency = Histogram("rollout_router_request_seconds", "End-to-end request latency, by endpoint",
                                 ["endpoint"], registry=r,
                                 buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))

    async def handle(self, request: web.Request) -> web.Response:
        """GET /metrics in the Prometheus text format."""
        resp = web.Response(body=generate_latest(self.registry))
        resp.content_type = CONTENT_TYPE_LATEST.split(";")[0]
        return resp


ENDPOINT_PATHS = {"/v1/completions": "completions", "/v1/chat/completions": "chat", "/v1/score": "score"}
"""Request paths counted in ``rollout_router_requests_total`` / ``_request_seconds``, by label."""


def metrics_middleware(metrics: RouterMetrics):
    """Count every request to :data:`ENDPOINT_PATHS` by endpoint and final HTTP status, the
    router's own 4xx included, and observe its latency. Must sit outside ``error_middleware`` so
    errors arrive as responses; a client that goes away counts as 499, anything unhandled as 500."""

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
            metrics.latency.labels(endpoint).observe(time.perf_counter() - started)
            metrics.requests.labels(endpoint, status).inc()

    return count
