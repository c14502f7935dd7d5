"""Who is calling: API keys for the OpenAI endpoints, the admin token, and the tenant.

Tokens are compared as bytes with ``hmac.compare_digest``, so any byte string a client sends
(non-ASCII included; aiohttp hands header bytes over as ``surrogateescape`` text) is safe to
compare and simply does not match. Every configured key is compared, so the time taken does not
tell which key a guess came close to.

The tenant of a request is the one its API key is bound to (``router.api_keys``), or the
``X-Tenant-Id`` header when ``router.tenant_header`` is on; a key's tenant wins, and a header
that disagrees with it is refused (403). The decision core folds the tenant into the cache salt,
so tenants never share cache blocks and cannot probe each other's prefixes.
"""

from __future__ import annotations

import hmac
from typing import Mapping

from aiohttp import web

from router.errors import BadRequest, RouterError, Unauthorized

TENANT_HEADER = "X-Tenant-Id"
TENANT = web.RequestKey("tenant", "str | None")
"""Key of the resolved tenant in the ``web.Request`` mapping (set by the edge middleware)."""


class Forbidden(RouterError):
    """The credentials are valid but may not do this (403)."""

    status = 403


def header_bytes(value: str) -> bytes:
    """A header value back as the bytes the client sent (any byte string, any text)."""
    try:
        return value.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return value.encode("utf-8", "surrogatepass")


def one_header(headers: Mapping[str, str], header: str, param: str,
               error: type[RouterError] = BadRequest) -> str | None:
    """The value of ``header`` (None when absent); ``error`` (400 by default) naming ``param`` when
    the request sends it more than once with different values: which one to act on would be a
    guess (aiohttp's ``headers.get`` takes the first, a proxy in front may take the last).
    ``headers``: a case-insensitive multidict (aiohttp's, the fast lane's), or a plain mapping."""
    value = headers.get(header)
    if value is not None and hasattr(headers, "getall"):
        values = headers.getall(header)
        if len(values) > 1 and any(v != value for v in values):
            raise error(f"header {header} is sent {len(values)} times with different values; send it once",
                        param=param)
    return value


def bearer_token(headers: Mapping[str, str]) -> bytes | None:
    """The token of ``Authorization: Bearer <token>`` as bytes, or None without one; 401 when
    ``Authorization`` is sent twice with different values."""
    scheme, _, token = (one_header(headers, "Authorization", "authorization", Unauthorized) or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return header_bytes(token.strip())


def token_matches(given: bytes | None, expected: str | None) -> bool:
    """True when ``given`` equals ``expected`` (compared as UTF-8 bytes in constant time)."""
    if given is None or not expected:
        return False
    return hmac.compare_digest(given, expected.encode("utf-8"))


class KeyBook:
    """The API keys of ``router.api_keys``, each with the tenant it acts for."""

    def __init__(self, keys: Mapping[str, str | None]):
        self._keys = [(k.encode("utf-8"), tenant) for k, tenant in keys.items()]

    @property
    def enabled(self) -> bool:
        """Whether the OpenAI endpoints need a key at all."""
        return bool(self._keys)

    def tenant_of(self, headers: Mapping[str, str]) -> str | None:
        """The tenant bound to the request's key (None: none bound). Unauthorized without a known key."""
        given = bearer_token(headers)
        found, tenant = False, None
        for key, bound in self._keys:  # no early exit: every key costs the same time
            if given is not None and hmac.compare_digest(given, key):
                found, tenant = True, bound
        if not found:
            raise Unauthorized("this endpoint needs 'Authorization: Bearer <key>' with a key from router.api_keys")
        return tenant


def resolve_tenant(headers: Mapping[str, str], book: KeyBook, *, header_allowed: bool,
                   max_chars: int) -> str | None:
    """The request's tenant (see the module docstring); 401/403/400 naming ``tenant``."""
    key_tenant = book.tenant_of(headers) if book.enabled else None
    claimed = one_header(headers, TENANT_HEADER, "tenant")
    if claimed is None:
        return key_tenant
    if not header_allowed:
        raise BadRequest(f"header {TENANT_HEADER} is not accepted: router.tenant_header is off", param="tenant")
    if not claimed or len(claimed) > max_chars or not claimed.isprintable() or claimed != claimed.strip():
        raise BadRequest(f"header {TENANT_HEADER} must be 1 to {max_chars} printable characters", param="tenant")
    try:
        claimed.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(f"header {TENANT_HEADER} must be UTF-8 text", param="tenant") from None
    if key_tenant is not None and claimed != key_tenant:
        raise Forbidden(f"header {TENANT_HEADER} names another tenant than the API key's", param="tenant")
    return claimed
