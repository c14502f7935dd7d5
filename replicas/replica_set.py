"""ReplicaSet: start, restart and stop N vLLM replicas under Ray, and describe them to the router.

Replica ``i`` is named ``replica-{i}`` for the set's whole life; a restart keeps the name and
gets a new actor, port, base URL and key. With ``cfg.urls`` the set only wraps existing servers
(no Ray, nothing launched, no restart).

While running, the set supervises its replicas (``replicas.supervisor``: restart a dead or
wedged one, with backoff and a restart budget), can ``add`` and ``remove`` (optionally drain)
replicas, and publishes every change as a :class:`~replicas.events.ReplicaEvent` to handlers
registered with :meth:`ReplicaSet.subscribe`. Each launched replica has its own key
(``replicas.auth``); the set's own calls and anyone using ``rs.auth`` as a client middleware
send it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable

import aiohttp

from cache_policy.types import ReplicaId
from replicas import ops
from replicas.auth import PROCESS_KEYS, ReplicaAuth, new_key
from replicas.config import ReplicaSetConfig, StartupError
from replicas.events import EventBus, Handler
from replicas.ids import replica_id, replica_index
from replicas.kv_events import KvEventSource, fetch_source
from replicas.membership import Membership
from replicas.metrics import scoring_cap_active
from replicas.served_model import ServedModel, agreed_block_size, fetch_served_model
from replicas.ray_users import _LOCAL_RAY, RAY_INIT_ATTEMPTS, _RayUsers  # noqa: F401 - re-exported
from replicas.supervisor import SupervisionConfig, Supervisor

STOP_TIMEOUT_S = 60.0
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
    kv_events: KvEventSource | None = None
    """Where the replica publishes KV cache events (``GET /kv_event_sources``); None: it does not."""
    api_key: str | None = field(default=None, repr=False)
    """The replica's key (``Authorization: Bearer``) for every path but ``/health``; None: none needed."""
    model_root: str | None = None
    """Where the server loaded its model from (``/v1/models`` ``root``: a folder or a hub name);
    None when it did not say (replicas launched here: ``ReplicaSetConfig.model``)."""
    max_model_len: int | None = None
    """The server's ``max_model_len`` as its ``/v1/models`` says; None when it did not say
    (replicas launched here run ``ReplicaSetConfig.max_model_len``)."""


class ReplicaSet(Membership):
    """The replicas of one ``ReplicaSetConfig``; use as ``async with ReplicaSet(cfg) as rs:``.

    ``endpoints`` is ordered by index and only holds started replicas. The set owns its actors
    and its share of Ray (see ``RayUsers``) and releases them in ``stop()``. ``supervision``
    configures the health/restart loop (``SupervisionConfig(enabled=False)`` turns it off).
    """

    def __init__(self, cfg: ReplicaSetConfig | None = None, supervision: SupervisionConfig | None = None) -> None:
        self.cfg = cfg or ReplicaSetConfig()
        self.auth = ReplicaAuth(mirror=PROCESS_KEYS)
        """Keys of the live replicas by origin; an aiohttp client middleware (``replicas.auth``)."""
        self.events = EventBus()
        self._supervisor = Supervisor(self, supervision or SupervisionConfig(), self.events)
        self._next_index = 0
        self.claim_index: Callable[[int], Awaitable[int]] | None = None
        """Where ``add`` takes a new index when several routers share state: given this set's own
        next index, one at least that large that no router has used (``router.state``); None:
        this set's own counter."""
        self._leaving: set[int] = set()
        self._launched: set[int] = set()
        """Indices this set launched, kept through a restart (its actor is gone for a moment)."""
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
        return self._endpoints[replica_index(rid)]

    async def start(self) -> list[ReplicaEndpoint]:
        """Start every replica concurrently (or wrap ``cfg.urls``) and return their endpoints."""
        if self._session is not None:
            raise RuntimeError("ReplicaSet.start() called twice; stop() it first")
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30), middlewares=(self.auth,))
        try:
            if self.cfg.urls:
                await self._wrap_urls()
            else:
                await self._launch_all()
        except BaseException:
            await self.stop()
            raise
        self._supervisor.start()
        return self.endpoints

    def subscribe(self, handler: Handler) -> Callable[[], None]:
        """Receive every :class:`~replicas.events.ReplicaEvent` from now on (``handler(event)``,
        sync or async; see ``replicas.events`` for the kinds); returns the unsubscribe function."""
        return self.events.subscribe(handler)

    @property
    def health_session(self) -> aiohttp.ClientSession:
        """The set's own HTTP session (sends the replicas' keys)."""
        return self._session

    async def restart(self, rid: ReplicaId) -> ReplicaEndpoint:
        """Stop replica ``rid`` (if still alive) and start a fresh one under the same name."""
        if self.cfg.urls:
            raise ValueError("ReplicaSet.restart: replicas given by ReplicaSetConfig.urls are not managed here")
        index = replica_index(rid)
        if index not in self._actors:
            raise KeyError(f"no launched replica {rid!r}; known: {[e.replica_id for e in self.endpoints]}")
        self._forget_endpoint(index)
        await self._stop_actor(self._actors.pop(index))
        return await self._launch(index)

    async def stop(self) -> None:
        """Stop supervision and every replica, close the HTTP session, release this set's share of Ray."""
        await self._supervisor.stop()
        await self.events.close()
        actors, self._actors = self._actors, {}
        self._launched.clear()
        self._endpoints.clear()
        self.auth.clear()
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

    def watched(self) -> dict[int, ReplicaEndpoint]:
        """Supervisor hook: the ready replicas by index, less those being removed (a copy)."""
        return {i: e for i, e in self._endpoints.items() if i not in self._leaving}

    def engine_stalled(self, rid: ReplicaId, reason: str) -> bool:
        """Router hook: ``rid``'s engine hung for good (``DecisionCore.restart_due``): restart it
        through the supervisor (``Supervisor.wedged``). True when a restart began; False for a
        replica this set did not launch (``urls``), an unknown one, or with supervision off."""
        try:
            index = replica_index(rid)
        except KeyError:
            return False
        return index in self._endpoints and self._supervisor.wedged(index, reason)

    def launched(self, rid: ReplicaId) -> bool:
        """Whether this set launched ``rid`` (from ``replicas.model``: a fresh start, or a
        restart, serves those weights, whatever the replica had loaded before)."""
        try:
            return replica_index(rid) in self._launched
        except KeyError:
            return False

    def managed(self, index: int) -> bool:
        """Supervisor hook: True if this set launched replica ``index`` (it can restart it)."""
        return index in self._actors

    async def process_alive(self, index: int) -> bool:
        """Supervisor hook: is replica ``index``'s server process running? Raises Ray's errors
        when its actor is gone."""
        return await self._actors[index].alive.remote()

    async def info(self, rid: ReplicaId):
        """The launched replica's :class:`~replicas.actor.ReplicaInfo` (URL, server pid = its
        process group id, log path); ``KeyError`` for one not launched here."""
        return await self._actors[replica_index(rid)].info.remote()

    async def give_up(self, index: int, reason: str) -> None:
        """Supervisor hook: stop replica ``index`` for good (the supervisor publishes ``removed``)."""
        logger.error("replica %s stopped for good: %s", replica_id(index), reason)
        await self._drop(index)

    def _require_started(self) -> None:
        if self._session is None:
            raise RuntimeError("ReplicaSet is not started; call start() (or use 'async with') first")

    def _take_index(self, wanted: int | None = None) -> int:
        index = self._next_index if wanted is None else wanted
        self._next_index = max(self._next_index, index + 1)
        return index

    def _forget_endpoint(self, index: int) -> None:
        endpoint = self._endpoints.pop(index, None)
        if endpoint is not None:
            self.auth.discard(endpoint)

    async def _drop(self, index: int) -> None:
        self._leaving.discard(index)
        self._forget_endpoint(index)
        self._launched.discard(index)
        actor = self._actors.pop(index, None)
        if actor is not None:
            await self._stop_actor(actor)


    async def _probe_scoring_cap(self, base_url: str) -> bool:
        """Hook: does this replica run our scoring-cap plugin? True iff its ``/metrics`` has
        ``rollout_router_scoring_cap_active`` = 1 (the plugin exports it); False otherwise."""
        if not self.cfg.enable_plugin and not self.cfg.urls:
            return False
        return scoring_cap_active(await ops.fetch_metrics_text(self._session, base_url))

    async def _wrap_urls(self) -> None:
        for index, url in enumerate(self.cfg.urls):
            await self._wrap(self._take_index(index), url, f"replicas.urls[{index}]")

    async def _wrap(self, index: int | None, url: str, what: str, model: str | None = None) -> ReplicaEndpoint:
        """Use the running server at ``url`` as replica ``index``: its block size and KV size from
        ``/metrics``, its model from ``/v1/models``. StartupError when it does not answer as a vLLM
        server, its block size differs from the other replicas' (one prefix hash needs one block
        size), or ``model`` is given and it serves another. ``index`` None: a new one
        (``Membership._new_index``), taken once the server answered."""
        if not await ops.is_healthy(self._session, url):
            raise StartupError(f"{what} {url} does not answer GET /health")
        try:
            m = await ops.fetch_metrics(self._session, url)
        except aiohttp.ClientResponseError as exc:
            hint = (": it needs an API key (started with --api-key), which the router has no way to send to a "
                    "replica it did not launch; start it without one and keep it reachable only through the router"
                    if exc.status in (401, 403) else "")
            raise StartupError(f"{what} {url} answers GET /metrics with HTTP {exc.status}{hint}") from None
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise StartupError(f"{what} {url}: GET /metrics failed ({exc!r})") from None
        except ValueError as exc:  # answered 200, but not with Prometheus text: not a vLLM server
            raise StartupError(f"{what} {url}: GET /metrics is not vLLM's Prometheus text ({exc})") from None
        others = [e for i, e in self._endpoints.items() if i != index]
        block_size = agreed_block_size(f"{what} {url}", m.block_size, self.cfg.block_size, others)
        served = await fetch_served_model(self._session, url)
        name = served.name if served else self.cfg.served_model_name
        if model is not None and name != model:
            raise StartupError(f"{what} {url} serves model {name!r} but the fleet serves {model!r}: every replica "
                               "behind one router must answer to the same model")
        if index is None:
            index = await self._new_index()
        self._endpoints[index] = await self._endpoint(index, url, block_size, m.num_gpu_blocks, served=served)
        return self._endpoints[index]

    async def _launch_all(self) -> None:
        from replicas.server import resolve_model

        self._model_path = await asyncio.to_thread(resolve_model, self.cfg)
        await self._init_ray()
        results = await asyncio.gather(
            *(self._launch(self._take_index(i)) for i in range(self.cfg.num_replicas)), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]

    async def _launch(self, index: int) -> ReplicaEndpoint:
        from replicas.actor import VllmReplicaActor

        num_gpus = 1 if self.cfg.engine == "gpu" else 0
        log_dir = str(self.log_dir / replica_id(index))
        key = new_key()
        actor = VllmReplicaActor.options(num_gpus=num_gpus).remote(self.cfg, index, self._model_path, log_dir, key)
        self._actors[index] = actor
        self._launched.add(index)
        info = await actor.start.remote()
        endpoint = await self._endpoint(index, info.base_url, info.block_size, info.num_gpu_blocks, key)
        self._endpoints[index] = endpoint
        return endpoint

    async def _endpoint(self, index: int, url: str, block_size: int, num_gpu_blocks: int,
                        api_key: str | None = None, served: ServedModel | None = None) -> ReplicaEndpoint:
        self.auth.set_key(url, api_key)  # the probes below must already send the key
        return ReplicaEndpoint(
            replica_id=replica_id(index),
            base_url=url,
            block_size=block_size or self.cfg.block_size,
            num_gpu_blocks=num_gpu_blocks,
            model=served.name if served else self.cfg.served_model_name,
            scoring_cap=await self._probe_scoring_cap(url),
            kv_events=await fetch_source(self._session, url),
            api_key=api_key,
            model_root=served.root if served else None,
            max_model_len=served.max_model_len if served else None,
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




def _run_name() -> str:
    return f"replicas-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
