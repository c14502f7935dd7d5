"""State several routers share (``router.state: redis``) or one router keeps (``memory``).

``make_state`` builds it from the router config; ``redis_state`` documents the request-path
hooks and the background sync, ``pins`` / ``versions`` / ``registry`` / ``peers`` each kind of
shared state and its consistency, ``redis_client`` the timeouts and the circuit breaker.
"""

from __future__ import annotations

from router.state.memory import MemoryState
from router.state.redis_state import RedisState


def make_state(kind: str, redis_url: str | None, cfg=None) -> MemoryState | RedisState:
    """``memory`` -> `MemoryState`; ``redis`` -> `RedisState` (``redis_url`` required), its
    timeouts and intervals from ``cfg`` (a ``RouterConfig``; defaults without). ValueError
    naming the field otherwise."""
    if kind == "memory":
        return MemoryState()
    if kind == "redis":
        if not redis_url:
            raise ValueError("router.state is 'redis' but router.redis_url is not set")
        if cfg is None:
            return RedisState(redis_url)
        return RedisState(redis_url, prefix=cfg.redis_prefix, timeout_s=cfg.redis_timeout_s,
                          breaker_failures=cfg.redis_breaker_failures, breaker_reset_s=cfg.redis_breaker_reset_s,
                          pin_ttl_s=cfg.redis_pin_ttl_s, sync_interval_s=cfg.state_sync_interval_s)
    raise ValueError(f"router.state must be 'memory' or 'redis', got {kind!r}")


__all__ = ["MemoryState", "RedisState", "make_state"]
