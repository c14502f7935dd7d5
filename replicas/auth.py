"""Replicas only the router can drive: a per-replica secret, checked in the replica, sent by us.

vLLM's ``--api-key`` guards only ``/v1``, ``/v2``, ``/inference`` and ``/cohere``
(``vllm/entrypoints/serve/middleware/authenticate.py``, ``GUARDED_PREFIX``); the dev endpoints
that ``VLLM_SERVER_DEV_MODE=1`` turns on (``/pause``, ``/resume``, ``/reset_prefix_cache``,
``/collective_rpc``, ``/update_weight_version``, weight transfer) and ``/metrics`` stay open.
So each replica the :class:`~replicas.replica_set.ReplicaSet` launches gets a fresh random key
(``new_key()``) in its environment (``KEY_ENV``, never on its command line, which any local
user can read in ``/proc``) and loads :class:`ReplicaAuthMiddleware` with vLLM's own
``--middleware`` flag: every path except ``OPEN_PATHS`` needs ``Authorization: Bearer <key>``
or gets 401. Only the process that launched the set (the router) holds the keys, on
:attr:`ReplicaEndpoint.api_key <replicas.replica_set.ReplicaEndpoint.api_key>`.

Callers send the key with :class:`ReplicaAuth`, an aiohttp client middleware that adds the
header to requests for a known replica origin (``scheme://host:port``) and to nothing else::

    http = aiohttp.ClientSession(middlewares=(PROCESS_KEYS,))  # every call through it is authenticated

:data:`PROCESS_KEYS` holds every key of every ``ReplicaSet`` in this process, kept current across
restarts, adds and removes (``replica_set.auth`` holds one set's; ``ReplicaAuth.for_endpoints``
builds one from endpoints received from elsewhere). The helpers in ``replicas.ops`` and
``replicas.weights_http`` look the key up there themselves, so they work on any session.
"""

from __future__ import annotations

import hmac
import os
import secrets
from typing import Iterable

from yarl import URL

KEY_ENV = "ROLLOUT_ROUTER_REPLICA_KEY"
"""Environment variable carrying a replica's key into its vLLM server process."""
MIDDLEWARE = "replicas.auth.ReplicaAuthMiddleware"
"""What ``build_command`` passes to vLLM's ``--middleware`` when the replica has a key."""
OPEN_PATHS = frozenset({"/health", "/ping"})
"""Liveness only; they reveal nothing and change nothing."""


def new_key() -> str:
    """A fresh 256-bit URL-safe key (43 characters)."""
    return secrets.token_urlsafe(32)


def bearer(key: str) -> dict[str, str]:
    """The header that carries ``key``."""
    return {"Authorization": f"Bearer {key}"}


def origin(url: str) -> str:
    """``scheme://host:port`` of ``url`` (the port made explicit), the key's lookup name."""
    u = URL(url)
    return f"{u.scheme}://{u.host}:{u.port}"


class ReplicaAuth:
    """origin -> key for the replicas a router talks to; usable as an aiohttp client middleware.

    Update it as replicas come and go (``set`` / ``discard``); a request to an origin it does
    not know goes out unchanged, so the keys never leave for another host.
    """

    def __init__(self, mirror: "ReplicaAuth | None" = None) -> None:
        self._keys: dict[str, str] = {}
        self._mirror = mirror

    @classmethod
    def for_endpoints(cls, endpoints: Iterable) -> "ReplicaAuth":
        """Seeded from ``ReplicaEndpoint``s (those without ``api_key`` are skipped)."""
        auth = cls()
        for ep in endpoints:
            auth.set(ep)
        return auth

    def set(self, endpoint) -> None:
        """Remember ``endpoint.api_key`` for ``endpoint.base_url`` (forget it if the key is None)."""
        self.set_key(endpoint.base_url, endpoint.api_key)

    def set_key(self, url: str, key: str | None) -> None:
        """Send ``key`` to ``url``'s origin from now on (None: send nothing there)."""
        if key:
            self._keys[origin(url)] = key
        else:
            self._keys.pop(origin(url), None)
        if self._mirror is not None:
            self._mirror.set_key(url, key)

    def discard(self, endpoint) -> None:
        """Forget ``endpoint``'s origin (a stopped or restarted replica)."""
        self.set_key(endpoint.base_url, None)

    def clear(self) -> None:
        """Forget every key (and take them out of the mirror too)."""
        for name in list(self._keys):
            self.set_key(name, None)

    def key(self, origin_name: str) -> str | None:
        """The key for an origin as :func:`origin` spells it, or None."""
        return self._keys.get(origin_name)

    def headers_for(self, url: str) -> dict[str, str]:
        """The auth header for ``url``, or ``{}`` for an origin without a key."""
        key = self._keys.get(origin(url))
        return bearer(key) if key else {}

    async def __call__(self, request, handler):
        """aiohttp ``ClientSession(middlewares=...)`` hook: add the header, then send."""
        key = self._keys.get(origin(str(request.url)))
        if key and "Authorization" not in request.headers:
            request.headers["Authorization"] = f"Bearer {key}"
        return await handler(request)


class ReplicaAuthMiddleware:
    """ASGI middleware inside the replica's vLLM server (loaded by ``--middleware``).

    Refuses with 401 every HTTP or websocket request whose path is not in ``OPEN_PATHS`` unless
    it carries ``Authorization: Bearer <key>`` with the key from ``KEY_ENV``. Without the variable
    it refuses everything but ``OPEN_PATHS`` (fail closed). Comparison is constant-time on bytes,
    so any header value, ASCII or not, is compared safely.
    """

    def __init__(self, app) -> None:
        self.app = app
        key = os.environ.get(KEY_ENV, "")
        self._expected = f"Bearer {key}".encode() if key else None

    def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            return self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path in OPEN_PATHS or self._allowed(scope):
            return self.app(scope, receive, send)
        return _refuse(scope, send)

    def _allowed(self, scope) -> bool:
        if self._expected is None:
            return False
        given = next((v for k, v in scope.get("headers", ()) if k.lower() == b"authorization"), b"")
        return hmac.compare_digest(given, self._expected)


PROCESS_KEYS = ReplicaAuth()
"""Every replica key this process holds (each ``ReplicaSet.auth`` mirrors into it)."""


def headers_for(url: str) -> dict[str, str]:
    """The auth header :data:`PROCESS_KEYS` has for ``url``, or ``{}``."""
    return PROCESS_KEYS.headers_for(url)


async def _refuse(scope, send) -> None:
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008})
        return
    body = b'{"error": {"message": "this replica is driven by its router only", "type": "Unauthorized", "code": 401}}'
    await send({"type": "http.response.start", "status": 401,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
