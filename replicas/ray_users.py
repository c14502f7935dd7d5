"""Ray is one per process: the ``ReplicaSet``s of a process share it through :data:`LOCAL_RAY`."""

from __future__ import annotations

import asyncio
import logging

RAY_INIT_ATTEMPTS = 3
logger = logging.getLogger(__name__)


class RayUsers:
    """Ray is one per process: count the ReplicaSets using it, and shut down only a Ray
    instance that a ReplicaSet started, when the last of them stops."""

    def __init__(self) -> None:
        self.users = 0
        self.started_here = False
        self._lock: asyncio.Lock | None = None
        self._lock_loop: asyncio.AbstractEventLoop | None = None

    async def acquire(self, address: str | None) -> None:
        try:
            import ray
        except ImportError as exc:  # a router-only install (`pip install .`): no Ray, no vLLM
            from replicas.config import StartupError

            raise StartupError("launching replicas needs Ray and vLLM: pip install '.[cpu]' or '.[gpu]' "
                               "(or list existing servers in replicas.urls)") from exc

        async with self._loop_lock():
            if self.users == 0 and not ray.is_initialized():
                await self._init(ray, address)
                self.started_here = True
            self.users += 1

    @staticmethod
    async def _init(ray, address: str | None) -> None:
        # A local raylet gets a fixed 30 s to register; on an overloaded machine it can miss it.
        # a local instance is ours: its start-up chatter (thread-signal and token-auth warnings,
        # "Started a local Ray instance") is not the user's business; errors still show
        kwargs = {"include_dashboard": False, "logging_level": logging.ERROR} if address is None else {}
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


LOCAL_RAY = RayUsers()
_RayUsers, _LOCAL_RAY = RayUsers, LOCAL_RAY  # the names replicas.replica_set has always used
