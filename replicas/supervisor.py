"""Supervision: watch every replica and restart a dead or wedged one, with backoff and a budget.

Why a supervisor loop in the replica set and not Ray's actor restart (``max_restarts``): Ray
restarts an actor only when the actor's own process dies. Here the failures are below it: the
vLLM server (or its engine core) dies while the actor lives, or the server hangs with every
process alive; Ray sees neither. A restarted actor would also come back without its server and
with nobody told its new URL. So the actors are plain (``max_restarts=0``) and this loop, in the
process that owns the set, checks each replica every ``interval_s``:

1. process: ``actor.alive()`` (the actor reaps the server's process group when it finds the
   server gone); a dead actor or server means restart now;
2. ``GET /health`` within ``health_timeout_s``: vLLM answers 503 once its engine is dead, so
   engine errors show here; a timeout, a refused connection, any status but 200 or any
   exception is a failed check. The first failed check publishes ``unhealthy``; the next 200
   publishes ``healthy``; ``restart_after_failures`` failures in a row mean wedged: restart.
3. an engine hung behind a live API server answers ``/health``; the router finds it stalled
   (no token finished while it holds work) and, after a few stalls in a row, calls
   :meth:`Supervisor.wedged` (``ReplicaSet.engine_stalled``): restart.

A restart waits ``backoff_initial_s * 2**k`` (at most ``backoff_max_s``), k = restarts already
made in the last ``restart_window_s``; past ``max_restarts`` in that window the replica is
given up (stopped, ``removed``). A failed restart counts against the budget and is retried.
Replicas given as ``urls`` are watched (``unhealthy``/``healthy``) but never restarted.
Any exception from one replica's check is logged once per cause and the loop goes on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import aiohttp

from replicas.events import EventBus

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SupervisionConfig:
    """How the replica set watches and restarts its replicas (defaults suit vLLM-CPU)."""

    enabled: bool = True
    """False: no background checks, no automatic restarts."""
    interval_s: float = 2.0
    """Seconds between two checks of one replica."""
    health_timeout_s: float = 10.0
    """A ``/health`` answer slower than this is a failed check (generous: a busy 2-core host is slow)."""
    restart_after_failures: int = 3
    """Failed checks in a row after which a live replica counts as wedged and is restarted."""
    max_restarts: int = 5
    """Restarts allowed per replica within ``restart_window_s``; one more gives it up."""
    restart_window_s: float = 600.0
    """The sliding window of the restart budget, seconds."""
    backoff_initial_s: float = 1.0
    """Wait before the first restart in a window; doubles with each further one."""
    backoff_max_s: float = 60.0
    """Longest wait before a restart."""

    def __post_init__(self) -> None:
        for name in ("interval_s", "health_timeout_s", "restart_window_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SupervisionConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.restart_after_failures < 1 or self.max_restarts < 0:
            raise ValueError("SupervisionConfig.restart_after_failures must be >= 1 and max_restarts >= 0")
        if not 0 <= self.backoff_initial_s <= self.backoff_max_s:
            raise ValueError("SupervisionConfig needs 0 <= backoff_initial_s <= backoff_max_s")


@dataclass
class RestartBudget:
    """Restarts of one replica in a sliding window (pure; times in seconds, clock passed in)."""

    cfg: SupervisionConfig
    times: deque = field(default_factory=deque)

    def recent(self, now: float) -> int:
        """Restarts within the last ``restart_window_s`` before ``now``."""
        while self.times and self.times[0] <= now - self.cfg.restart_window_s:
            self.times.popleft()
        return len(self.times)

    def exhausted(self, now: float) -> bool:
        return self.recent(now) >= self.cfg.max_restarts

    def delay(self, now: float) -> float:
        """Backoff before the next restart: ``initial * 2**recent``, capped at ``backoff_max_s``."""
        return min(self.cfg.backoff_max_s, self.cfg.backoff_initial_s * 2 ** self.recent(now))

    def record(self, now: float) -> None:
        self.times.append(now)


@dataclass
class _Watch:
    budget: RestartBudget
    failures: int = 0
    unhealthy: bool = False
    restarting: asyncio.Task | None = None


class Supervisor:
    """The loop described in the module doc, over an owner (the ``ReplicaSet``) that provides
    ``watched()``, ``managed(index)``, ``process_alive(index)``, ``restart(rid)``,
    ``give_up(index, reason)`` (stop it for good) and ``health_session``; events go to ``events``."""

    def __init__(self, owner, cfg: SupervisionConfig, events: EventBus) -> None:
        self.owner, self.cfg, self.events = owner, cfg, events
        self._watches: dict[int, _Watch] = {}
        self._task: asyncio.Task | None = None
        self._logged: set[str] = set()

    def start(self) -> None:
        if self.cfg.enabled and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Stop checking and cancel any restart in progress."""
        tasks = [w.restarting for w in self._watches.values() if w.restarting] + [self._task]
        for task in filter(None, tasks):
            task.cancel()
        await asyncio.gather(*filter(None, tasks), return_exceptions=True)
        self._task = None
        self._watches.clear()

    def forget(self, index: int) -> None:
        """Stop watching ``index`` (being removed); a restart in progress is cancelled."""
        watch = self._watches.pop(index, None)
        if watch and watch.restarting and watch.restarting is not asyncio.current_task():
            watch.restarting.cancel()

    async def check_all(self) -> None:
        """One round: check every watched replica concurrently (never raises)."""
        indices = list(self.owner.watched())
        results = await asyncio.gather(*(self._check(i) for i in indices), return_exceptions=True)
        for index, result in zip(indices, results):
            if isinstance(result, Exception):
                self._log_once(f"check:{type(result).__name__}", "supervisor check of replica %d failed: %r",
                               index, result)

    async def _run(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self.cfg.interval_s)

    async def _check(self, index: int) -> None:
        watch = self._watches.setdefault(index, _Watch(RestartBudget(self.cfg)))
        if watch.restarting is not None:
            return
        if self.owner.managed(index) and not await self._process_alive(index):
            self._begin_restart(index, watch, "its server process (or actor) is gone")
            return
        problem = await self._health_problem(index)
        if problem is None:
            watch.failures = 0
            if watch.unhealthy:
                watch.unhealthy = False
                self.events.publish("healthy", self._rid(index), self._endpoint(index))
            return
        watch.failures += 1
        if not watch.unhealthy:
            watch.unhealthy = True
            self.events.publish("unhealthy", self._rid(index), self._endpoint(index), problem)
        if self.owner.managed(index) and watch.failures >= self.cfg.restart_after_failures:
            self._begin_restart(index, watch, f"{watch.failures} failed health checks in a row, last: {problem}")

    async def _process_alive(self, index: int) -> bool:
        try:
            return await asyncio.wait_for(self.owner.process_alive(index), self.cfg.health_timeout_s)
        except asyncio.TimeoutError:
            return True  # a slow actor is not a dead one; /health decides
        except Exception as exc:  # noqa: BLE001 - RayActorError and friends: the actor is gone
            self._log_once(f"alive:{type(exc).__name__}", "replica %d actor unreachable: %r", index, exc)
            return False

    async def _health_problem(self, index: int) -> str | None:
        """None when ``GET /health`` answers 200 in time; else what went wrong, in words."""
        url = self._endpoint(index).base_url + "/health"
        timeout = aiohttp.ClientTimeout(total=self.cfg.health_timeout_s)
        try:
            async with self.owner.health_session.get(url, timeout=timeout) as resp:
                await resp.content.read(4096)  # whatever it is (HTML, bad UTF-8): never decoded
                return None if resp.status == 200 else f"GET /health answered {resp.status}"
        except asyncio.TimeoutError:
            return f"GET /health gave no answer within {self.cfg.health_timeout_s:g} s"
        except Exception as exc:  # noqa: BLE001 - any failure of a peer is a failed check
            return f"GET /health failed: {type(exc).__name__}: {exc}"

    def wedged(self, index: int, reason: str) -> bool:
        """Replica ``index`` hangs in a way ``/health`` does not show (its router found its engine
        stalled: ``PolicyConfig.stall_restart_after``): restart it, within the same budget as
        any restart. True when a restart began; False when supervision is off, this set did not
        launch it, or a restart is already under way."""
        if not self.cfg.enabled or not self.owner.managed(index):
            return False
        watch = self._watches.setdefault(index, _Watch(RestartBudget(self.cfg)))
        if watch.restarting is not None:
            return False
        self._begin_restart(index, watch, reason)
        return True

    def _begin_restart(self, index: int, watch: _Watch, reason: str) -> None:
        watch.restarting = asyncio.get_running_loop().create_task(self._restart(index, watch, reason))

    async def _restart(self, index: int, watch: _Watch, reason: str) -> None:
        rid, last_endpoint = self._rid(index), self._endpoint(index)
        self.events.publish("restarting", rid, last_endpoint, reason)
        try:
            while True:
                now = time.monotonic()
                if watch.budget.exhausted(now):
                    why = (f"restart budget spent: {watch.budget.recent(now)} restarts within "
                           f"{self.cfg.restart_window_s:g} s; last cause: {reason}")
                    log.error("replica %s given up: %s", rid, why)
                    self.forget(index)
                    await self.owner.give_up(index, why)
                    self.events.publish("removed", rid, last_endpoint, why)
                    return
                await asyncio.sleep(watch.budget.delay(now))
                watch.budget.record(time.monotonic())
                try:
                    endpoint = await self.owner.restart(rid)
                except Exception as exc:  # noqa: BLE001 - a failed start is retried within the budget
                    reason = f"restart failed: {exc!r}"[:2000]
                    log.warning("replica %s: %s", rid, reason)
                    continue
                watch.failures, watch.unhealthy = 0, False
                self.events.publish("restarted", rid, endpoint, f"after: {reason}"[:2000])
                return
        finally:
            watch.restarting = None

    def _endpoint(self, index: int):
        return self.owner.watched()[index]

    def _rid(self, index: int):
        return self._endpoint(index).replica_id

    def _log_once(self, cause: str, msg: str, *args) -> None:
        if cause not in self._logged:
            self._logged.add(cause)
            log.warning(msg + " (logged once per cause)", *args)
