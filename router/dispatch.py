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

from cache_policy.admission import blocks_needed
from cache_policy.hashing import block_hashes
from cache_policy.policy import Policy
from cache_policy.types import Decision, ReplicaId, RequestView
from router.admission import AdmissionController, ReplicaGone, Ticket
from router.config import RouterConfig
from router.errors import NoReplica, UpstreamError, with_router_param
from router.metrics import RouterMetrics
from router.parse import ParsedRequest, RoutingKeys
from router.pool import ReplicaPool
from router.shared_state import SharedState, adopt_shared_pins, publish_pins
from router.proxy import ReplicaUnreachable, UpstreamResult, post_json, relay_stream
from router.versions import SaltChoice, WeightVersions

log = logging.getLogger(__name__)

UPSTREAM_PATH = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True)
class Placement:
    """Where a request runs and what the router expects to be cached there."""

    decision: Decision
    base_url: str
    expected_cached_tokens: int
    cache_salt: str | None
    weight_version: int | None = None
    """Version the replica served when the request was dispatched."""
    version_mark: int = 0
    """Position in the replica's version log at dispatch (see ``WeightVersions.mark``)."""

    @property
    def replica_id(self) -> ReplicaId:
        return self.decision.replica_id

    def headers(self) -> dict[str, str]:
        headers = {
            "X-Rollout-Replica": self.replica_id,
            "X-Rollout-Expected-Cached-Tokens": str(self.expected_cached_tokens),
            "X-Rollout-Route-Reason": self.decision.reason.value,
        }
        if self.weight_version is not None:
            headers["X-Rollout-Weight-Version"] = str(self.weight_version)
        return headers

    def annotation(self, requested: int | None, versions: list[int] | None = None) -> dict[str, Any]:
        """``weight_version``: the version the tokens were produced under (the last one when
        ``weight_versions``, every version loaded while the request ran, holds more than one)."""
        versions = versions or ([] if self.weight_version is None else [self.weight_version])
        return {
            "replica": self.replica_id,
            "expected_cached_tokens": self.expected_cached_tokens,
            "route_reason": self.decision.reason.value,
            "cache_salt": self.cache_salt,
            "weight_version": versions[-1] if versions else requested,
            "weight_versions": versions,
            "requested_weight_version": requested,
        }


class Dispatcher:
    """Routes and forwards requests for one router app. Event-loop only, not thread-safe."""

    def __init__(self, cfg: RouterConfig, pool: ReplicaPool, policy: Policy, metrics: RouterMetrics,
                 http: aiohttp.ClientSession, *, admission: AdmissionController | None = None,
                 versions: WeightVersions | None = None, shared: SharedState | None = None):
        self.cfg = cfg
        self.pool = pool
        self.policy = policy
        self.metrics = metrics
        self.http = http
        self.admission = admission
        self.versions = versions
        self.shared = shared

    def salt_for(self, keys: RoutingKeys) -> SaltChoice:
        """The cache salt (and weight version) a request with ``keys`` runs under."""
        if self.versions is None:
            return SaltChoice(None, keys.weight_version, None)
        return self.versions.assign(keys, time.monotonic())

    def request_view(self, token_ids: list[int], keys: RoutingKeys, cache_salt: str | None,
                     kind: str = "generate") -> RequestView:
        hashes = block_hashes(token_ids, self.pool.block_size, cache_salt)
        return RequestView(tuple(hashes), len(token_ids), keys.session_id, keys.group_id, kind,
                           keys.weight_version)

    def place(self, view: RequestView, cache_salt: str | None, exclude: list[ReplicaId],
              choice: SaltChoice | None = None) -> Placement:
        """Ask the policy; record the decision. Raises NoReplica when none is eligible.

        Replicas out of rotation are skipped, and so are, for a salted ``choice``, replicas
        that do not serve its version (while one does).
        """
        if self.versions is not None:
            exclude = list(exclude) + self.versions.excluded(choice or SaltChoice(cache_salt, None, None))
        decision = self.policy.select(view, self.pool.views(exclude=exclude))
        if decision is None:
            raise NoReplica("no healthy replica can take the request; retry later",
                            headers={"Retry-After": "1"})
        self.policy.on_routed(view, decision)
        self.metrics.decisions.labels(self.policy.name, decision.reason.value).inc()
        state = self.pool.get(decision.replica_id)
        expected = decision.matched_blocks * state.endpoint.block_size
        mark = self.versions.mark(decision.replica_id) if self.versions is not None else 0
        return Placement(decision, state.endpoint.base_url, expected, cache_salt, state.weight_version, mark)

    async def place_when_available(self, view: RequestView, cache_salt: str | None, exclude: list[ReplicaId],
                                   choice: SaltChoice | None = None) -> Placement:
        """``place``, waiting (up to ``queue_timeout_s``) while a weight update holds replicas."""
        deadline = time.monotonic() + (self.admission.cfg.queue_timeout_s if self.admission else 30.0)
        if self.shared is not None:
            await adopt_shared_pins(self.shared, self.policy, view, self.pool.ids())
        while True:
            try:
                placement = self.place(view, cache_salt, exclude, choice)
                if self.shared is not None:
                    await publish_pins(self.shared, view, placement.replica_id)
                return placement
            except NoReplica:
                left = deadline - time.monotonic()
                if self.versions is None or not self.versions.updating() or left <= 0:
                    raise
                await self.versions.wait_rotation(left)

    async def admit(self, placement: Placement, view: RequestView, new_tokens: int) -> Ticket | None:
        """Room on the placed replica for ``view``'s prompt plus ``new_tokens`` (see router.admission)."""
        if self.admission is None:
            return None
        rid, matched = placement.replica_id, placement.decision.matched_blocks
        total = blocks_needed(view.num_prompt_tokens + new_tokens, 0, self.pool.get(rid).endpoint.block_size)
        return await self.admission.acquire(rid, total, matched, view.session_id, view.group_id)

    def release(self, ticket: Ticket | None) -> None:
        if ticket is not None and self.admission is not None:
            self.admission.release(ticket)

    def weight_versions(self, placement: Placement) -> list[int] | None:
        """Versions the placed replica served from dispatch until now."""
        if self.versions is None:
            return None
        return self.versions.versions_since(placement.replica_id, placement.version_mark)

    async def run(self, view: RequestView, cache_salt: str | None,
                  attempt: Callable[[Placement], Awaitable[web.StreamResponse]], *,
                  choice: SaltChoice | None = None, new_tokens: int = 0) -> web.StreamResponse:
        """Place, admit and run ``attempt``, moving to another replica while it is unreachable."""
        tried: list[ReplicaId] = []
        while True:
            placement = await self.place_when_available(view, cache_salt, tried, choice)
            rid = placement.replica_id
            try:
                ticket = await self.admit(placement, view, new_tokens)
            except ReplicaGone:
                self.policy.on_finished(view, rid)
                tried.append(rid)
                continue
            except BaseException:
                self.policy.on_finished(view, rid)
                raise
            self.pool.acquire(rid)
            self.metrics.in_flight.labels(rid).inc()
            try:
                resp = await attempt(placement)
                if 400 <= resp.status < 500:  # refused before any block was cached
                    self.policy.on_rejected(view, placement.decision)
                return resp
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
                self.release(ticket)
                self.policy.on_finished(view, rid)

    async def forward(self, client: web.Request, parsed: ParsedRequest, token_ids: list[int],
                      cache_salt: str | None = None) -> web.StreamResponse:
        """Route and proxy a completion or chat request; the response names the replica."""
        choice = self.salt_for(parsed.keys) if cache_salt is None else SaltChoice(cache_salt, None, None)
        view = self.request_view(token_ids, parsed.keys, choice.salt)

        async def attempt(placement: Placement) -> web.StreamResponse:
            body = self._upstream_body(parsed, token_ids, placement)
            url = placement.base_url + UPSTREAM_PATH[parsed.endpoint]
            if parsed.stream:
                resp = await relay_stream(client, self.http, url, body, placement.headers())
            else:
                resp = await post_json(self.http, url, body)
            if isinstance(resp, UpstreamResult):  # a whole answer: a JSON body, or refused before streaming
                resp = self._json_response(resp, placement, parsed.keys.weight_version, parsed.endpoint)
            if resp.status == 200:  # prompts a replica refused were never prefilled
                self._count_prompt(placement, len(token_ids))
            return resp

        return await self.run(view, choice.salt, attempt, choice=choice, new_tokens=self._new_tokens(parsed.body))

    def _new_tokens(self, body: dict[str, Any]) -> int:
        """Tokens the request may generate (all its samples), for admission."""
        limit = body.get("max_tokens") or body.get("max_completion_tokens") or self.cfg.admission_default_max_tokens
        n = body.get("n") or 1
        return int(limit) * int(n) if isinstance(limit, int) and isinstance(n, int) else 0

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

    def _json_response(self, result, placement: Placement, weight_version: int | None,
                       endpoint: str) -> web.Response:
        payload = result.payload
        if result.status == 200 and isinstance(payload, dict):
            payload["rollout_router"] = placement.annotation(weight_version, self.weight_versions(placement))
            cached = ((payload.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
            if isinstance(cached, int):
                self.metrics.reported_cached.labels(placement.replica_id).inc(cached)
            return web.Response(text=json.dumps(payload), status=200, content_type="application/json",
                                headers=placement.headers())
        if 400 <= result.status < 500 and isinstance(payload, dict):  # name the field as our API does
            return web.Response(text=json.dumps(with_router_param(payload, endpoint)), status=result.status,
                                content_type="application/json", headers=placement.headers())
        return web.Response(body=result.raw, status=result.status, content_type="application/json",
                            headers=placement.headers())
