"""The edge middleware: who is calling, and a bounded body, before any handler runs.

* ``/v1/*``: the API key (``router.api_keys``) and the tenant (``router.auth``), stored on the
  request under ``router.auth.TENANT``.
* ``/admin/*``: the admin token compared as bytes, so a non-ASCII token is a 401 like any
  other wrong one (``router.admin`` then checks it again as text, now known to be ASCII-safe).
* Any request with a body: ``Content-Length`` over ``router.max_body_bytes`` is a 413 before a
  byte is read; the body is read within ``router.body_timeout_s`` or the request gets a 408.
  aiohttp enforces the size on chunked bodies (``client_max_size``). A ``Content-Encoding`` is
  undone here (``router.content_encoding``: 415 for a coding the router does not read, 400 for
  a body that is not what the header says, 413 past the size once inflated); a body that breaks
  off short of its length is a 400. Handlers take the result from :func:`body_of`. Slow headers
  are bounded by the server's keep-alive timer (``router.server``).
"""

from __future__ import annotations

import asyncio

from aiohttp import hdrs, web

from router.auth import TENANT, KeyBook, bearer_token, resolve_tenant, token_matches
from router.config import AppConfig
from router.content_encoding import PARAM as ENCODING_PARAM
from router.content_encoding import coding_of, decode_body
from router.errors import BadRequest, PayloadTooLarge, RequestTimeout, RouterError, Unauthorized

BODY = web.RequestKey("body", bytes)
"""The request body as the edge read it, its ``Content-Encoding`` undone (:func:`body_of`)."""


def edge_middleware(cfg: AppConfig):
    """The middleware for ``cfg`` (keys compiled once)."""
    book = KeyBook(cfg.router.api_keys)
    r = cfg.router

    @web.middleware
    async def edge(request: web.Request, handler):
        if request.path.startswith("/v1/"):
            request[TENANT] = resolve_tenant(request.headers, book, header_allowed=r.tenant_header,
                                             max_chars=r.max_key_chars)
        elif request.path.startswith("/admin/") and not token_matches(bearer_token(request.headers), r.admin_token):
            raise Unauthorized("admin endpoints need 'Authorization: Bearer <router.admin_token>'"
                               + ("" if r.admin_token else " (router.admin_token is not set: admin is disabled)"))
        if request.body_exists:
            request[BODY] = await read_body(request, r.max_body_bytes, r.body_timeout_s)
        return await handler(request)

    return edge


def head_check(cfg: AppConfig):
    """Whether a ``/v1/*`` request's headers pass what the edge checks before reading its body
    (its API key and tenant, :func:`router.auth.resolve_tenant`): ``check(headers) -> bool``. The
    fast lane asks before it waits for a body, and leaves a request that fails to the edge itself
    (the 401/403/400 at once, never after the body)."""
    book, r = KeyBook(cfg.router.api_keys), cfg.router

    def check(headers) -> bool:
        try:
            resolve_tenant(headers, book, header_allowed=r.tenant_header, max_chars=r.max_key_chars)
        except RouterError:
            return False
        return True

    return check


async def read_body(request: web.Request, max_bytes: int, timeout_s: float) -> bytes:
    """The whole body, its ``Content-Encoding`` undone; 413 / 408 / 415, or 400 naming what is malformed."""
    coding = coding_of(request.headers.get(hdrs.CONTENT_ENCODING))
    length = request.content_length
    if length is not None and length > max_bytes:
        raise PayloadTooLarge(f"request body is {length} bytes; at most {max_bytes} (router.max_body_bytes)",
                              param="body")
    raw = await _receive(request, max_bytes, timeout_s)
    if coding is None or getattr(request.content, "total_compressed_bytes", None) is not None:  # aiohttp inflated it
        return raw
    return await asyncio.to_thread(decode_body, raw, coding, max_bytes)


async def _receive(request: web.Request, max_bytes: int, timeout_s: float) -> bytes:
    """The body's bytes as sent, within ``timeout_s``."""
    try:
        if request.content.is_eof():  # received whole already (a small body): no wait to bound
            return await request.read()
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except TimeoutError:
        raise body_late(timeout_s) from None
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLarge(f"request body is over {max_bytes} bytes (router.max_body_bytes)",
                              param="body") from None
    except web.RequestPayloadError as exc:  # it broke off short of its length, or aiohttp could not inflate it
        detail = " ".join(str(exc).rpartition("message:")[2].split())
        param = ENCODING_PARAM if "content-encoding" in detail.lower() else "body"
        raise BadRequest(f"request body is malformed: {detail}", param=param) from None


def body_late(timeout_s: float) -> RequestTimeout:
    """The 408 of a body not received within ``timeout_s`` (``router.body_timeout_s``)."""
    return RequestTimeout(f"request body not received within {timeout_s:g} s (router.body_timeout_s)", param="body")


def body_of(request: web.Request) -> bytes:
    """The body the edge read (``b""`` when the request has none)."""
    return request.get(BODY, b"")


def tenant_of(request: web.Request) -> str | None:
    """The tenant the edge resolved for ``request`` (None: no tenant)."""
    return request.get(TENANT)
