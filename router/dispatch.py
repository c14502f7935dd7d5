"""One request's life after parsing: hash, ask the policy, forward, retry, release.

    tokens -> RequestView -> policy.select -> acquire -> proxy -> release/on_finished
                                   ^                           |
                                   +---- ReplicaUnreachable ---+  (another replica, bounded)

Retrying is safe only while nothing reached the client; `proxy` raises `ReplicaUnreachable`
exactly then.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import aiohttp
from aiohttp import web

from cache_policy.hashing import block_hashes
from cache_policy.policy import Policy
from cache_policy.types import Decision, ReplicaId, RequestView
from router.config import RouterConfig
from router.errors import NoReplica, UpstreamError
from router.metrics import RouterMetrics
from router.parse import ParsedRequest, RoutingKeys
from router.pool import ReplicaPool
from router.proxy import ReplicaUnreachable, post_json, relay_stream

log = logging.getLogger(__name__)

UPSTREAM_PATH = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True)
class Placement:
    """Where a request runs and what the router expects to be cached there."""

    decision: Decision
    base_url: str
    expected_cached_tokens: int
    cache_salt: str | None

    @property
    def replica_id(self) -> ReplicaId:
        return self.decision.replica_id

    def headers(self) -> dict[str, str]:
        return {
            "X-Rollout-Replica": self.replica_id,
            "X-Rollout-Expected-Cached-Tokens": str(self.expected_cached_tokens),
            "X-Rollout-Route-Reason": self.decision.reason.value,
        }

    def annotation(self, weight_version: int | None) -> dict[str, Any]:
        return {
            "replica": self.replica_id,
            "expected_cached_tokens": self.expected_cached_tokens,
            "route_reason": self.decision.reason.value,
            "cache_salt": self.cache_salt,
            "weight_version": weight_version,
        }


class Dispatcher:
    """Routes and forwards requests for one router app. Event-loop only, not thread-safe."""

    def __init__(self, cfg: RouterConfig, pool: ReplicaPool, policy: Policy, metrics: RouterMetrics,
                 http: aiohttp.ClientSession):
        self.cfg = cfg
        self.pool = pool
        self.policy = policy
        self.metrics = metrics
        self.http = http

    def request_view(self, token_ids: list[int], keys: RoutingKeys, cache_salt: str | None,
                     kind: str = "generate") -> RequestView:
        hashes = block_hashes(token_ids, self.pool.block_size, cache_salt)
        return RequestView(tuple(hashes), len(token_ids), keys.session_id, keys.group_id, kind,
                           keys.weight_version)

    def place(self, view: RequestView, cache_salt: str | None, exclude: list[ReplicaId]) -> Placement:
        """Ask the policy; record the decision. Raises NoReplica when none is eligible."""
        decision = self.policy.select(view, self.pool.views(exclude=exclude))
        if decision is None:
            raise NoReplica("no healthy replica can take the request; retry later",
                            headers={"Retry-After": "1"})
        self.policy.on_routed(view, decision)
        self.metrics.decisions.labels(self.policy.name, decision.reason.value).inc()
        state = self.pool.get(decision.replica_id)
        expected = decision.matched_blocks * state.endpoint.block_size
        return Placement(decision, state.endpoint.base_url, expected, cache_salt)

    async def run(self, view: RequestView, cache_salt: str | None,
                  attempt: Callable[[Placement], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        """Place and run ``attempt``, moving to another replica while it is unreachable."""
        tried: list[ReplicaId] = []
        while True:
            placement = self.place(view, cache_salt, tried)
            rid = placement.replica_id
            self.pool.acquire(rid)
            self.metrics.in_flight.labels(rid).inc()
            try:
                return await attempt(placement)
            except ReplicaUnreachable as exc:
                log.warning("replica %s unreachable: %s", rid, exc)
                self.pool.get(rid).healthy = False
                tried.append(rid)
                if len(tried) > self.cfg.connect_retries:
                    raise UpstreamError(f"replica {rid} unreachable and retries exhausted: {exc}") from exc
                self.metrics.retries.labels("unreachable").inc()
            finally:
                self.pool.release(rid)
                self.metrics.in_flight.labels(rid).dec()
                self.policy.on_finished(view, rid)

    async def forward(self, client: web.Request, parsed: ParsedRequest, token_ids: list[int],
                      cache_salt: str | None = None) -> web.StreamResponse:
        """Route and proxy a completion or chat request; the response names the replica."""
        view = self.request_view(token_ids, parsed.keys, cache_salt)
        started = time.perf_counter()

        async def attempt(placement: Placement) -> web.StreamResponse:
            body = self._upstream_body(parsed, token_ids, placement)
            url = placement.base_url + UPSTREAM_PATH[parsed.endpoint]
            self._count_prompt(placement, len(token_ids))
            if parsed.stream:
                return await relay_stream(client, self.http, url, body, placement.headers())
            result = await post_json(self.http, url, body)
            return self._json_response(result, placement, parsed.keys.weight_version)

        try:
            resp = await self.run(view, cache_salt, attempt)
        finally:
            self.metrics.latency.labels(parsed.endpoint).observe(time.perf_counter() - started)
        self.metrics.requests.labels(parsed.endpoint, str(resp.status)).inc()
        return resp

    def _upstream_body(self, parsed: ParsedRequest, token_ids: list[int], placement: Placement) -> dict[str, Any]:
        body = dict(parsed.body)
        if parsed.endpoint == "completions":
            body["prompt"] = token_ids  # the engine sees exactly the tokens the router hashed
        body.setdefault("model", self.pool.model)
        if placement.cache_salt is not None:
            body["cache_salt"] = placement.cache_salt
        return body

    def _count_prompt(self, placement: Placement, num_tokens: int) -> None:
        rid = placement.replica_id
        self.metrics.prompt_tokens.labels(rid).inc(num_tokens)
        self.metrics.predicted_cached.labels(rid).inc(placement.expected_cached_tokens)

    def _json_response(self, result, placement: Placement, weight_version: int | None) -> web.Response:
        payload = result.payload
        if result.status == 200 and isinstance(payload, dict):
            payload["rollout_router"] = placement.annotation(weight_version)
            cached = ((payload.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
            if isinstance(cached, int):
                self.metrics.reported_cached.labels(placement.replica_id).inc(cached)
            return web.Response(text=json.dumps(payload), status=200, content_type="application/json",
                                headers=placement.headers())
        return web.Response(body=result.raw, status=result.status, content_type="application/json",
                            headers=placement.headers())
