"""Redis with a time limit of its own on every call, and a circuit breaker (issue 13).

Every call goes through :meth:`GuardedRedis.call`: it fails with :class:`StateUnavailable`
after ``timeout_s`` (``router.redis_timeout_s``), whatever Redis does (down: connection refused
at once; hung, e.g. SIGSTOPped: the deadline). After ``failures`` consecutive failures the
breaker opens: calls fail at once, without touching the network, for ``reset_s`` seconds; then
one call at a time probes (half-open) and the first success closes it. So a Redis that is gone
or hung costs a request at most one timeout, and most requests nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

log = logging.getLogger(__name__)
T = TypeVar("T")


class StateUnavailable(Exception):
    """Redis did not answer in time, refused, failed, or the breaker is open."""


class Breaker:
    """closed -> (``failures`` in a row) -> open -> (``reset_s`` later) half-open -> closed | open.

    ``clock``: monotonic seconds. Not thread-safe (event loop only).
    """

    def __init__(self, failures: int, reset_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if failures < 1 or reset_s <= 0:
            raise ValueError(f"breaker needs failures >= 1 and reset_s > 0, got {failures}, {reset_s}")
        self.failures, self.reset_s, self.clock = failures, reset_s, clock
        self._streak = 0
        self._opened_at: float | None = None
        self._probing = False
        self.opened = 0
        """How many times the breaker opened (a metric)."""

    @property
    def state(self) -> str:
        """``closed`` | ``open`` | ``half_open``."""
        if self._opened_at is None:
            return "closed"
        return "half_open" if self.clock() - self._opened_at >= self.reset_s else "open"

    def allow(self) -> bool:
        """Whether a call may go to Redis now (in half-open state: one probe at a time)."""
        state = self.state
        if state == "closed":
            return True
        if state == "half_open" and not self._probing:
            self._probing = True
            return True
        return False

    def success(self) -> bool:
        """A call succeeded; True when this closed an open breaker (Redis is back)."""
        was_open = self._opened_at is not None
        self._streak, self._opened_at, self._probing = 0, None, False
        return was_open

    def failure(self) -> bool:
        """A call failed; True when this opened the breaker."""
        self._streak += 1
        was_probe, self._probing = self._probing, False
        if was_probe or (self._opened_at is None and self._streak >= self.failures):
            newly = self._opened_at is None
            self._opened_at = self.clock()
            self.opened += newly
            return newly
        return False


class GuardedRedis:
    """A ``redis.asyncio`` client whose every call has a deadline and a breaker.

    ``on_back``: called (no arguments) when a call succeeds after the breaker was open, so the
    owner can reconcile. The client connects lazily: a Redis that is down at start costs nothing.
    """

    def __init__(self, url: str, *, timeout_s: float, failures: int = 3, reset_s: float = 1.0,
                 on_back: Callable[[], None] | None = None) -> None:
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        self.url, self.timeout_s = url, timeout_s
        options = {"decode_responses": True, "socket_connect_timeout": max(0.5, 5 * timeout_s),
                   "socket_timeout": max(1.0, 20 * timeout_s),
                   # one immediate retry on a fresh connection (a pooled one Redis closed, e.g. after
                   # a restart), still within the call's deadline; timeouts are never retried
                   "retry": Retry(NoBackoff(), 1), "retry_on_error": [RedisConnectionError]}
        self.client = aioredis.from_url(url, **options)
        self.background = aioredis.from_url(url, **options)
        """A second connection pool for the sync loop and pub/sub, so their slow calls never hold
        the request path's pool (redis-py connects under a pool-wide lock)."""
        self.breaker = Breaker(failures, reset_s)
        self.on_back = on_back
        self.last_error: str | None = None
        self.calls = self.failed_calls = 0
        self.waited_s: deque[float] = deque(maxlen=100_000)
        """Seconds each request-path call kept its caller waiting (fast failures included)."""

    @property
    def available(self) -> bool:
        """False while the breaker is open (Redis recently failed)."""
        return self.breaker.state == "closed"

    async def call(self, fn: Callable[[Any], Awaitable[T]], *, timeout_s: float | None = None,
                   background: bool = False) -> T:
        """``await fn(client)`` within ``timeout_s`` (default: the configured one); ``background``:
        on the sync loop's own pool.

        The call runs as its own task and the caller stops waiting at the deadline whatever the
        client does with the cancellation, so the deadline is hard. Raises StateUnavailable on
        any Redis or network error, on the deadline, or at once while the breaker is open."""
        if not self.breaker.allow():
            if not background:
                self.waited_s.append(0.0)
            raise StateUnavailable(f"redis circuit open ({self.last_error})")
        self.calls += 1
        started = time.monotonic()
        task = asyncio.ensure_future(fn(self.background if background else self.client))
        try:
            done, _ = await asyncio.wait({task}, timeout=timeout_s or self.timeout_s)
            if not done:
                task.cancel()
                task.add_done_callback(_retrieve)
                raise TimeoutError(f"no answer within {timeout_s or self.timeout_s:g} s")
            result = task.result()
        except asyncio.CancelledError:
            task.cancel()
            task.add_done_callback(_retrieve)
            raise
        except (RedisError, OSError, TimeoutError, asyncio.TimeoutError) as exc:
            self._waited(started, background)
            self.failed_calls += 1
            self.last_error = f"{type(exc).__name__}: {exc}"[:200]
            if self.breaker.failure():
                log.warning("redis %s unavailable, serving from local state: %s", self.url, self.last_error)
            raise StateUnavailable(self.last_error) from exc
        self._waited(started, background)
        if self.breaker.success():
            log.warning("redis %s is back: reconciling shared state", self.url)
            if self.on_back is not None:
                self.on_back()
        return result

    def _waited(self, started: float, background: bool) -> None:
        if not background:
            self.waited_s.append(time.monotonic() - started)

    async def close(self) -> None:
        """Close both connection pools (bounded: 1 s each)."""
        for client in (self.client, self.background):
            try:
                async with asyncio.timeout(max(1.0, self.timeout_s)):
                    await client.aclose()
            except (RedisError, OSError, TimeoutError, asyncio.TimeoutError):
                pass


def _retrieve(task: asyncio.Future) -> None:
    """Consume an abandoned call's outcome (no 'exception never retrieved' noise)."""
    if not task.cancelled():
        task.exception()
