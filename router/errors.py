"""Domain errors and the one middleware that turns them into OpenAI-style JSON errors.

Caller mistakes are 4xx naming the field; a replica failure that cannot be retried is 502;
no eligible replica is 503; an overloaded router is 429 with Retry-After.
"""

from __future__ import annotations

import json
import logging

from aiohttp import web

log = logging.getLogger(__name__)


class RouterError(Exception):
    """Base: ``status`` is the HTTP status, ``param`` the offending request field if any."""

    status = 500
    type = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers or {}


class BadRequest(RouterError):
    """The request body or headers are invalid (400); ``param`` names the field."""

    status = 400
    type = "invalid_request_error"


class Unauthorized(RouterError):
    status = 401
    type = "authentication_error"


class NoReplica(RouterError):
    """No healthy replica can take the request (503)."""

    status = 503
    type = "service_unavailable"


class Overloaded(RouterError):
    """Admission refused the request (429); carries Retry-After."""

    status = 429
    type = "rate_limit_error"


class UpstreamError(RouterError):
    """A replica failed and the request could not safely be retried (502)."""

    status = 502
    type = "upstream_error"


REPLICA_PARAMS = {"input_tokens": {"completions": "prompt", "chat": "messages", "score": "context"},
                  "body.model": {"completions": "model", "chat": "model", "score": "model"}}
"""vLLM's names for fields (``error.param`` in its 4xx answers) -> this router's request fields."""


def router_param(param: object, endpoint: str) -> object:
    """The field of *our* request that a replica's ``error.param`` refers to, for ``endpoint``
    (``"completions"``, ``"chat"``, ``"score"``); unknown names pass through unchanged."""
    return REPLICA_PARAMS.get(param, {}).get(endpoint, param) if isinstance(param, str) else param


def with_router_param(payload: dict, endpoint: str) -> dict:
    """A replica's JSON error answer with ``error.param`` renamed by :func:`router_param`."""
    error = payload.get("error")
    if isinstance(error, dict) and "param" in error:
        payload = {**payload, "error": {**error, "param": router_param(error["param"], endpoint)}}
    return payload


def error_response(status: int, message: str, *, type_: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> web.Response:
    body = {"error": {"message": message, "type": type_, "param": param, "code": status}}
    return web.Response(status=status, text=json.dumps(body), content_type="application/json", headers=headers)


@web.middleware
async def error_middleware(request: web.Request, handler):
    """Convert RouterError (and aiohttp's own HTTP errors) to JSON; the only such place."""
    try:
        return await handler(request)
    except RouterError as exc:
        if exc.status >= 500:
            log.warning("%s %s -> %d: %s", request.method, request.path, exc.status, exc.message)
        return error_response(exc.status, exc.message, type_=exc.type, param=exc.param, headers=exc.headers)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(exc.status, exc.reason, type_="http_error", headers=None)
