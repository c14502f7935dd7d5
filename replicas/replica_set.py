"""ReplicaSet: start, restart and stop N vLLM replicas under Ray, and describe them to the router.

Replica ``i`` is named ``replica-{i}`` for the set's whole life; a restart keeps the name and
gets a new actor, port and base URL. With ``cfg.urls`` the set only wraps existing servers
(no Ray, nothing launched, no restart).
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from cache_policy.types import ReplicaId
from replicas import ops
from replicas.config import ReplicaSetConfig
from replicas.metrics import scoring_cap_active

STOP_TIMEOUT_S = 60.0
RAY_INIT_ATTEMPTS = 3
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaEndpoint:
    """One ready replica as the router addresses it."""

    replica_id: ReplicaId
    base_url: str
    block_size: int
    num_gpu_blocks: int
    model: str
    scoring_cap: bool = False


def replica_id(index: int) -> ReplicaId:
    """The stable name of replica ``index``: ``"replica-{index}"``."""
    return ReplicaId(f"replica-{index}")


class ReplicaSet:
    """The replicas of one ``ReplicaSetConfig``; use as ``async with ReplicaSet(cfg) as rs:``.

    ``endpoints`` is ordered by index and only holds started replicas. The set owns its actors
    and its share of Ray (see ``_RayUsers``) and releases them in ``stop()``.
    """

    def __init__(self, cfg: ReplicaSetConfig | None = None) -> None:
        self.cfg = cfg or ReplicaSetConfig()
        self._endpoints: dict[int, ReplicaEndpoint] = {}
        self._actors: dict[int, object] = {}
        self._model_path = ""
        self._session: aiohttp.ClientSession | None = None
        self._uses_ray = False
        root = self.cfg.log_dir or Path(tempfile.gettempdir()) / "rollout-router" / _run_name()
        self.log_dir = Path(root)

    @property
    def endpoints(self) -> list[ReplicaEndpoint]:
        """The started replicas, by index."""
        return [self._endpoints[i] for i in sorted(self._endpoints)]

    def endpoint(self, rid: ReplicaId) -> ReplicaEndpoint:
        """The endpoint named ``rid``; ``KeyError`` if there is none."""
        return self._endpoints[_index(rid)]

    async def start(self) -> list[ReplicaEndpoint]:
        """Start every replica concurrently (or wrap ``cfg.urls``) and return their endpoints."""
        if self._session is not None:
            raise RuntimeError("ReplicaSet.start() called twice; stop() it first")
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        try:
            if self.cfg.urls:
                await self._wrap_urls()
            else:
                await self._launch_all()
        except BaseException:
            await self.stop()
            raise
        return self.endpoints

    async def restart(self, rid: ReplicaId) -> ReplicaEndpoint:
        """Stop replica ``rid`` (if still alive) and start a fresh one under the same name."""
        if self.cfg.urls:
            raise ValueError("ReplicaSet.restart: replicas given by ReplicaSetConfig.urls are not managed here")
        index = _index(rid)
        if index not in self._actors:
            raise KeyError(f"no launched replica {rid!r}; known: {[e.replica_id for e in self.endpoints]}")
        self._endpoints.pop(index, None)
        await self._stop_actor(self._actors.pop(index))
        return await self._launch(index)

    async def stop(self) -> None:
        """Stop every replica, close the HTTP session, and release this set's share of Ray."""
        actors, self._actors = self._actors, {}
        self._endpoints.clear()
        await asyncio.gather(*(self._stop_actor(a) for a in actors.values()))
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._uses_ray:
            self._uses_ray = False
            await _LOCAL_RAY.release()

    async def __aenter__(self) -> "ReplicaSet":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    async def _probe_scoring_cap(self, base_url: str) -> bool:
        """Hook: does this replica run our scoring-cap plugin? True iff its ``/metrics`` has
        ``rollout_router_scoring_cap_active`` = 1 (the plugin exports it); False otherwise."""
        if not self.cfg.enable_plugin and not self.cfg.urls:
            return False
        return scoring_cap_active(await ops.fetch_metrics_text(self._session, base_url))

    async def _wrap_urls(self) -> None:
        for index, url in enumerate(self.cfg.urls):
            if not await ops.is_healthy(self._session, url):
                raise RuntimeError(f"ReplicaSetConfig.urls[{index}] {url} does not answer GET /health")
            m = await ops.fetch_metrics(self._session, url)
            self._endpoints[index] = await self._endpoint(index, url, m.block_size, m.num_gpu_blocks)

    async def _launch_all(self) -> None:
        from replicas.server import resolve_model

        self._model_path = await asyncio.to_thread(resolve_model, self.cfg)
        await self._init_ray()
        results = await asyncio.gather(
            *(self._launch(i) for i in range(self.cfg.num_replicas)), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]

    async def _launch(self, index: int) -> ReplicaEndpoint:
        from replicas.actor import VllmReplicaActor

        num_gpus = 1 if self.cfg.engine == "gpu" else 0
        log_dir = str(self.log_dir / replica_id(index))
        actor = VllmReplicaActor.options(num_gpus=num_gpus).remote(self.cfg, index, self._model_path, log_dir)
        self._actors[index] = actor
        info = await actor.start.remote()
        endpoint = await self._endpoint(index, info.base_url, info.block_size, info.num_gpu_blocks)
        self._endpoints[index] = endpoint
        return endpoint

    async def _endpoint(self, index: int, url: str, block_size: int, num_gpu_blocks: int) -> ReplicaEndpoint:
        return ReplicaEndpoint(
            replica_id=replica_id(index),
            base_url=url,
            block_size=block_size or self.cfg.block_size,
            num_gpu_blocks=num_gpu_blocks,
            model=self.cfg.served_model_name,
            scoring_cap=await self._probe_scoring_cap(url),
        )

    async def _init_ray(self) -> None:
        if not self._uses_ray:
            await _LOCAL_RAY.acquire(self.cfg.ray_address)
            self._uses_ray = True

    @staticmethod
    async def _stop_actor(actor) -> None:
        import ray

        try:
            await asyncio.wait_for(actor.stop.remote(), STOP_TIMEOUT_S)
        except (ray.exceptions.RayError, asyncio.TimeoutError):
            pass  # the actor is gone or stuck: ray.kill below takes its server down (PDEATHSIG)
        ray.kill(actor, no_restart=True)


class _RayUsers:
    """Ray is one per process: count the ReplicaSets using it, and shut down only a Ray
    instance that a ReplicaSet started, when the last of them stops."""

    def __init__(self) -> None:
        self.users = 0
        self.started_here = False
        self._lock: asyncio.Lock | None = None
        self._lock_loop: asyncio.AbstractEventLoop | None = None

    async def acquire(self, address: str | None) -> None:
        import ray

        async with self._loop_lock():
            if self.users == 0 and not ray.is_initialized():
                await self._init(ray, address)
                self.started_here = True
            self.users += 1

    @staticmethod
    async def _init(ray, address: str | None) -> None:
        # A local raylet gets a fixed 30 s to register; on an overloaded machine it can miss it.
        kwargs = {"include_dashboard": False} if address is None else {}
        for attempt in range(1, RAY_INIT_ATTEMPTS + 1):
            try:
                await asyncio.to_thread(ray.init, address=address, ignore_reinit_error=True,
                                        log_to_driver=False, **kwargs)
                return
            except Exception as exc:  # Ray raises a bare Exception on a startup timeout
                await asyncio.to_thread(ray.shutdown)
                if attempt == RAY_INIT_ATTEMPTS:
                    raise RuntimeError(f"ray.init(address={address!r}) failed {attempt} times: {exc}") from exc
                logger.warning("ray.init failed (attempt %d of %d), retrying: %s", attempt, RAY_INIT_ATTEMPTS, exc)

    async def release(self) -> None:
        import ray

        self.users -= 1
        if self.users == 0 and self.started_here:
            self.started_here = False
            await asyncio.to_thread(ray.shutdown)

    def _loop_lock(self) -> asyncio.Lock:
        loop = asyncio.get_running_loop()
        if self._lock_loop is not loop:
            self._lock, self._lock_loop = asyncio.Lock(), loop
        return self._lock


_LOCAL_RAY = _RayUsers()


def _index(rid: ReplicaId) -> int:
    prefix, _, num = str(rid).rpartition("-")
    if prefix != "replica" or not num.isdigit():
        raise KeyError(f"not a replica id: {rid!r} (expected 'replica-<n>')")
    return int(num)


def _run_name() -> str:
    return f"replicas-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
