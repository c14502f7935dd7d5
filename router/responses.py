"""What every answer says about how it was routed: headers and the ``rollout_router`` annotation.

The version contract (DESIGN rule 6): ``weight_version`` is the version of the weights the
replica served while the request ran (the last one when ``weight_versions``, every version
loaded meanwhile, holds more than one); ``cache_salt`` names the version whose KV it reused.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from cache_policy.core import DecisionCore, Job
from router.errors import with_router_param
from router.proxy import UpstreamResult


def route_headers(job: Job, *, expose_cached: bool = True) -> dict[str, str]:
    """``X-Rollout-*`` headers: replica, route reason, attempt, weight version, expected cached tokens.

    ``X-Rollout-Attempt``: which placement answered, from 1; each earlier one is a replica the
    request left before anything reached the client (it failed there, or left rotation while the
    request waited in admission)."""
    headers = {"X-Rollout-Replica": str(job.replica_id), "X-Rollout-Route-Reason": job.decision.reason.value,
               "X-Rollout-Attempt": str(len(job.tried) + 1)}
    if expose_cached:
        headers["X-Rollout-Expected-Cached-Tokens"] = str(job.expected_cached_tokens)
    if job.weight_version is not None:
        headers["X-Rollout-Weight-Version"] = str(job.weight_version)
    return headers


def annotation(job: Job, core: DecisionCore, *, expose_cached: bool = True) -> dict[str, Any]:
    """The ``rollout_router`` object of a JSON answer."""
    requested = job.spec.weight_version
    versions = core.versions_since(job) or ([] if job.weight_version is None else [job.weight_version])
    out = {
        "replica": job.replica_id, "route_reason": job.decision.reason.value, "cache_salt": job.salt,
        "weight_version": versions[-1] if versions else requested, "weight_versions": versions,
        "requested_weight_version": requested,
    }
    if expose_cached:
        out["expected_cached_tokens"] = job.expected_cached_tokens
    return out


def json_answer(result: UpstreamResult, job: Job, core: DecisionCore, endpoint: str, *,
                expose_cached: bool = True) -> web.Response:
    """A replica's whole answer for the client: annotated on 200, its 4xx with our field names."""
    headers = route_headers(job, expose_cached=expose_cached)
    payload = result.payload
    if result.status == 200 and isinstance(payload, dict):
        payload["rollout_router"] = annotation(job, core, expose_cached=expose_cached)
        return web.Response(text=json.dumps(payload), status=200, content_type="application/json", headers=headers)
    if 400 <= result.status < 500 and isinstance(payload, dict):
        return web.Response(text=json.dumps(with_router_param(payload, endpoint)), status=result.status,
                            content_type="application/json", headers=headers)
    return web.Response(body=result.raw, status=result.status, content_type="application/json", headers=headers)
