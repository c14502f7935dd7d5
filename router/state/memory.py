"""``router.state: memory``: one router, its core is the whole truth; the same API as Redis."""

from __future__ import annotations

import time

from cache_policy.core import DecisionCore, Job, RequestSpec
from router.state.peers import new_router_id


class MemoryState:
    """The shared-state API (``router.state.redis_state.RedisState``) for a single router:
    nothing to read or claim, versions need no publishing, the update lock is local."""

    available = True

    def __init__(self) -> None:
        self.router_id = new_router_id()
        self._lock: tuple[str, float] | None = None

    async def before_open(self, core: DecisionCore, spec: RequestSpec) -> None:
        """Nothing to confirm: this router's core is the whole truth."""
        return None

    async def after_place(self, core: DecisionCore, job: Job, seen: None, now: float) -> None:
        """Nothing to claim."""
        return None

    async def end_session(self, session_id: str) -> bool:
        """No other router holds sessions: False (the core's own end is the whole of it)."""
        return False

    def _holder(self) -> str | None:
        if self._lock is not None and self._lock[1] <= time.monotonic():
            self._lock = None
        return self._lock[0] if self._lock is not None else None

    async def acquire_update_lock(self, owner: str, ttl_s: float) -> bool:
        """True when ``owner`` now holds the in-process update lock for ``ttl_s`` seconds."""
        if self._holder() is not None:
            return False
        self._lock = (owner, time.monotonic() + ttl_s)
        return True

    async def refresh_update_lock(self, owner: str, ttl_s: float) -> bool:
        """Extend ``owner``'s lock by ``ttl_s``; False if it does not hold it."""
        if self._holder() != owner:
            return False
        self._lock = (owner, time.monotonic() + ttl_s)
        return True

    async def release_update_lock(self, owner: str, now: bool = False) -> None:
        """Release the lock if ``owner`` holds it (at once: no publication to wait for)."""
        if self._holder() == owner:
            self._lock = None

    async def update_lock_holder(self) -> str | None:
        """Who holds the lock (None: free)."""
        return self._holder()

    async def publish_versions(self, core: DecisionCore, recomputed: dict | None = None,
                               folders: dict[int, str] | None = None) -> bool:
        """No other router to tell: always True."""
        return True

    def shared_folder(self, version: int) -> str | None:
        """No other router loads weights: None."""
        return None

    async def await_marked(self, timeout_s: float = 0.0) -> list[str]:
        """No other router to wait for: none late."""
        return []

    async def claim_replica_index(self, floor: int) -> int:
        """No other router adds replicas: ``floor`` (the replica set's own next index)."""
        return floor

    async def claim_server(self, addresses: list[str], ttl_s: float) -> bool:
        """No other router adds servers: True (this router's own check is the whole of it)."""
        return True

    async def release_server(self, addresses: list[str], added: bool) -> None:
        """Nothing held."""
        return None

    async def drained_everywhere(self, rid) -> bool:
        """No other router has requests anywhere: True."""
        return True

    async def push_registry(self) -> None:
        """No registry to write."""
        return None

    async def start(self, app, core: DecisionCore) -> None:
        """Nothing to join."""
        return None

    async def run(self) -> None:
        """No sync loop."""
        return None

    async def close(self) -> None:
        """Nothing to close."""
        return None

    def describe(self) -> dict:
        """``{"kind": "memory", "router", "available"}``."""
        return {"kind": "memory", "router": self.router_id, "available": True}
