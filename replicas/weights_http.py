"""Transport for the weight-update operations: one control call to a vLLM dev endpoint.

Every call is sent with ``Connection: close``. When a dev endpoint fails inside the engine
(``/collective_rpc`` -> HTTP 500), vLLM's server drops the TCP connection after answering; a
pooled keep-alive connection reused for the next call (typically ``/resume``) then fails with
``ConnectionResetError``. Control calls are rare, so a fresh connection each costs nothing.
Every call carries the replica's key when this process holds it (``replicas.auth``).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, Mapping

import aiohttp

from replicas.auth import headers_for

CLOSE = {"Connection": "close"}


@dataclass(frozen=True)
class Answer:
    """What one control call got back. ``status`` 0 = no HTTP answer (see ``body``)."""

    status: int
    """HTTP status, or 0 when the call failed before an answer (connection error, timeout)."""
    body: Any
    """Parsed JSON, or the raw text when the body is not JSON, or the transport error text."""
    timed_out: bool = False
    """No answer within the call's timeout (the server took the request and said nothing: a hung
    engine behind a live API server, or a slow one), as opposed to a connection that failed."""

    @property
    def ok(self) -> bool:
        return self.status == 200

    def describe(self) -> str:
        """A one-line reason for a failed call, with vLLM's own error message when it sent one."""
        if self.status == 0:
            return str(self.body)
        message = _vllm_message(self.body)
        return f"HTTP {self.status}: {message}"


async def call(
    http: aiohttp.ClientSession,
    method: str,
    url: str,
    *,
    params: Mapping[str, str] | None = None,
    body: Any = None,
    timeout_s: float | None = None,
) -> Answer:
    """One control call; never raises for HTTP or transport errors (they come back in ``Answer``).

    ``timeout_s`` None means no client-side limit beyond the session's own.
    """
    timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s is not None else None
    try:
        async with http.request(
            method, url, params=params, json=body, headers={**CLOSE, **headers_for(url)}, timeout=timeout
        ) as resp:
            return Answer(resp.status, _parse(await resp.text()))
    except asyncio.TimeoutError:
        return Answer(0, f"no answer from {method} {url} within {timeout_s} s", timed_out=True)
    except aiohttp.ClientError as err:
        return Answer(0, f"{method} {url} failed: {type(err).__name__}: {err}")


def _parse(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _vllm_message(body: Any) -> str:
    """vLLM errors look like ``{"error": {"message": ...}}``, ``{"error": "..."}`` or ``{"detail": ...}``."""
    if isinstance(body, dict):
        err = body.get("error", body.get("detail"))
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if err is not None:
            return str(err)
    return str(body)[:500]


async def is_paused(http: aiohttp.ClientSession, base_url: str, timeout_s: float) -> bool | None:
    """``GET /is_paused`` (vLLM's dev endpoint): whether the engine is paused; None when it could
    not tell (no answer, or a server without the dev endpoints, which nobody can pause either)."""
    answer = await call(http, "GET", f"{base_url}/is_paused", timeout_s=timeout_s)
    if answer.ok and isinstance(answer.body, dict) and isinstance(answer.body.get("is_paused"), bool):
        return answer.body["is_paused"]
    return None
