"""Router state shared by several router processes through Redis (``router.state: redis``).

What is shared: session and group pins (so turn k+1 of a session reaches the replica of turn k
whichever router receives it), the weight version each replica has loaded, and the replica
registry. The policy stays pure and local: before a decision the router *pulls* the shared pins
of the request's keys into the policy's pin table; after it *pushes* the pins it recorded.

Keys (all under ``prefix``): ``pin:session:<id>`` / ``pin:group:<id>`` -> replica id (expire
after ``pin_ttl_s``), hash ``versions`` replica id -> loaded version, hash ``replicas`` replica
id -> endpoint JSON. With ``router.state: memory`` the `MemoryState` no-op is used instead.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Protocol, Sequence

from cache_policy.core import DecisionCore, Job
from cache_policy.types import ReplicaId, RequestView

from redis.exceptions import RedisError

log = logging.getLogger(__name__)


class SharedState(Protocol):
    """Pins, loaded versions and the replica registry, shared or local."""

    async def pull_pins(self, view: RequestView) -> dict[str, ReplicaId]: ...

    async def push_pins(self, view: RequestView, replica_id: ReplicaId) -> None: ...

    async def set_loaded_version(self, replica_id: ReplicaId, version: int) -> None: ...

    async def loaded_versions(self) -> dict[ReplicaId, int]: ...

    async def register(self, endpoints: Sequence[object]) -> None: ...

    async def close(self) -> None: ...

    async def adopt_pins(self, core: DecisionCore, job: Job) -> None: ...

    async def publish_pins(self, job: Job) -> None: ...


class _PinSync:
    """``adopt_pins`` / ``publish_pins`` on top of a state's ``pull_pins`` / ``push_pins``."""

    async def adopt_pins(self, core: DecisionCore, job: Job) -> None:
        await adopt_shared_pins(self, core, job)  # type: ignore[arg-type]

    async def publish_pins(self, job: Job) -> None:
        await publish_pins(self, job)  # type: ignore[arg-type]


class MemoryState(_PinSync):
    """Single-router default: the core's own pin table is the whole truth."""

    def __init__(self) -> None:
        self._versions: dict[ReplicaId, int] = {}

    async def pull_pins(self, view: RequestView) -> dict[str, ReplicaId]:
        return {}

    async def push_pins(self, view: RequestView, replica_id: ReplicaId) -> None:
        return None

    async def set_loaded_version(self, replica_id: ReplicaId, version: int) -> None:
        self._versions[replica_id] = version

    async def loaded_versions(self) -> dict[ReplicaId, int]:
        return dict(self._versions)

    async def register(self, endpoints: Sequence[object]) -> None:
        return None

    async def close(self) -> None:
        return None


def _pin_keys(view: RequestView) -> dict[str, str]:
    keys = {}
    if view.session_id is not None:
        keys["session"] = view.session_id
    if view.group_id is not None:
        keys["group"] = view.group_id
    return keys


class RedisState(_PinSync):
    """`SharedState` in Redis (``redis.asyncio``). Raises redis errors on I/O failure."""

    def __init__(self, url: str, *, prefix: str = "rollout-router:", pin_ttl_s: int = 3600):
        import redis.asyncio as aioredis

        self._redis = aioredis.from_url(url, decode_responses=True)
        self.prefix = prefix
        self.pin_ttl_s = pin_ttl_s

    def _key(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    async def pull_pins(self, view: RequestView) -> dict[str, ReplicaId]:
        keys = _pin_keys(view)
        if not keys:
            return {}
        values = await self._redis.mget([self._key("pin", kind, k) for kind, k in keys.items()])
        return {kind: ReplicaId(v) for kind, v in zip(keys, values) if v is not None}

    async def push_pins(self, view: RequestView, replica_id: ReplicaId) -> None:
        keys = _pin_keys(view)
        if not keys:
            return
        async with self._redis.pipeline(transaction=False) as pipe:
            for kind, k in keys.items():
                pipe.set(self._key("pin", kind, k), replica_id, ex=self.pin_ttl_s)
            await pipe.execute()

    async def set_loaded_version(self, replica_id: ReplicaId, version: int) -> None:
        await self._redis.hset(self._key("versions"), replica_id, version)

    async def loaded_versions(self) -> dict[ReplicaId, int]:
        raw = await self._redis.hgetall(self._key("versions"))
        return {ReplicaId(k): int(v) for k, v in raw.items()}

    async def register(self, endpoints: Sequence[object]) -> None:
        mapping = {ep.replica_id: json.dumps(dataclasses.asdict(ep)) for ep in endpoints}  # type: ignore[attr-defined]
        if mapping:
            await self._redis.hset(self._key("replicas"), mapping=mapping)

    async def registered(self) -> dict[str, dict]:
        raw = await self._redis.hgetall(self._key("replicas"))
        return {k: json.loads(v) for k, v in raw.items()}

    async def close(self) -> None:
        await self._redis.aclose()


def make_state(kind: str, redis_url: str | None) -> SharedState:
    """``memory`` -> `MemoryState`; ``redis`` -> `RedisState` (``redis_url`` required)."""
    if kind == "memory":
        return MemoryState()
    if kind == "redis":
        if not redis_url:
            raise ValueError("router.state is 'redis' but router.redis_url is not set")
        return RedisState(redis_url)
    raise ValueError(f"router.state must be 'memory' or 'redis', got {kind!r}")


async def adopt_shared_pins(state: SharedState, core: DecisionCore, job: Job) -> None:
    """Copy the shared pins of ``job``'s keys into the core before it places the job.

    A Redis failure is contained: it is logged and the local pins decide (less affinity, no error).
    """
    try:
        shared = await state.pull_pins(job.view)
    except (RedisError, OSError) as exc:
        log.warning("shared state unavailable, routing on local pins: %r", exc)
        return
    keys = {"session": job.spec.session_id, "group": job.spec.group_id}
    for kind, replica in shared.items():
        core.adopt_pin(kind, keys[kind], replica)


async def publish_pins(state: SharedState, job: Job) -> None:
    """Share where ``job``'s session/group now runs; a Redis failure is logged, not raised."""
    try:
        await state.push_pins(job.view, job.replica_id)
    except (RedisError, OSError) as exc:
        log.warning("shared state unavailable, pin not shared: %r", exc)
