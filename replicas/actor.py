"""One vLLM OpenAI server process, owned by one Ray actor.

``VllmReplica`` is a plain async class (usable without Ray); ``VllmReplicaActor`` is the same
class as a Ray actor with ``num_cpus=0`` (the server's threads are pinned by
``VLLM_CPU_OMP_THREADS_BIND``, not by Ray), so two fit on a 2-core machine.

Lifecycle: ``start()`` launches the server in its own process group on a free port, logs to
``{log_dir}/server.log`` (appended; one header per start) and waits for ``/health``;
``stop()`` sends SIGTERM to the group, then SIGKILL after a grace period. The server is
launched through a shim that sets ``PR_SET_PDEATHSIG``, so it also dies if the actor is
killed without ``stop()``; its engine core and workers die with their parents the same way
(``replicas/launcher/sitecustomize.py``), and ``alive()`` reaps the whole group the moment it
finds the server gone, so no engine process outlives its API server.

The server binds ``cfg.host``, except that ``0.0.0.0`` / ``::`` become this node's address:
a replica listens on loopback or on the one address its router uses, never on every interface.
With an ``api_key`` the server requires it on every path but ``/health`` (``replicas.auth``).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import ray

from replicas import ops, procs
from replicas.auth import bearer
from replicas.config import ReplicaSetConfig
from replicas.server import FRONTEND_CPUS_ENV, build_command, build_env, free_port

HEALTH_POLL_S = 0.5
STOP_GRACE_S = 15.0
LOG_TAIL_LINES = 40
PORT_ATTEMPTS = 3
_PORT_IN_USE = "address already in use"
# Linux: ask the kernel to SIGTERM the server when its parent (this actor) dies, then exec it.
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "try:\n ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))\n"
    "except Exception:\n pass\n"
    f"cpus = os.environ.pop({FRONTEND_CPUS_ENV!r}, '')\n"
    "if cpus:\n os.sched_setaffinity(0, [int(c) for c in cpus.split(',')])\n"
    "os.execvp(sys.argv[1], sys.argv[1:])"
)
"""Runs first in the replica's process: die with the actor (``PR_SET_PDEATHSIG``), move onto
``ReplicaSetConfig.frontend_cpus`` if set (the worker re-pins its own threads), then exec."""


@dataclass(frozen=True)
class ReplicaInfo:
    """What a started replica reports about itself."""

    base_url: str
    pid: int
    block_size: int
    num_gpu_blocks: int
    log_path: str


class VllmReplica:
    """Owns one vLLM server subprocess; every method is async and never blocks the loop."""

    def __init__(self, cfg: ReplicaSetConfig, index: int, model_path: str, log_dir: str,
                 api_key: str | None = None) -> None:
        self._cfg = cfg
        self._api_key = api_key
        self._index = index
        self._model_path = model_path
        self._log_path = Path(log_dir) / "server.log"
        self._proc: subprocess.Popen | None = None
        self._base_url = ""
        self._log_offset = 0
        self._rpc_dir: str | None = None  # vLLM's ZMQ socket files of the running server

    async def start(self) -> ReplicaInfo:
        """Launch the server and wait until ``/health`` answers; raise ``RuntimeError`` if not."""
        if self._proc is not None and self._proc.poll() is None:
            raise RuntimeError(f"replica {self._index} is already running (pid {self._proc.pid})")
        for attempt in range(1, PORT_ATTEMPTS + 1):
            try:
                self._launch(free_port(self._bind_host()))
                await self._wait_healthy()
                return await self.info()
            except _PortTaken:
                if attempt == PORT_ATTEMPTS:
                    raise RuntimeError(self._failure("kept losing its port to other processes")) from None

    async def info(self) -> ReplicaInfo:
        """Base URL, server pid, and ``block_size`` / ``num_gpu_blocks`` from ``/metrics``."""
        if self._proc is None:
            raise RuntimeError(f"replica {self._index} was never started")
        async with self._session() as session:
            m = await ops.fetch_metrics(session, self._base_url)
        return ReplicaInfo(self._base_url, self._proc.pid, m.block_size, m.num_gpu_blocks, str(self._log_path))

    async def alive(self) -> bool:
        """True while the server process runs (says nothing about ``/health``). A server found
        dead has the rest of its process group (engine core, workers) killed at once."""
        if self._proc is None:
            return False
        if self._proc.poll() is None:
            return True
        _signal_group(self._proc.pid, signal.SIGKILL)
        return False

    async def group_pids(self) -> list[int]:
        """Live (not zombie) processes of this replica's process group; ``[]`` once stopped."""
        return procs.group_members(self._proc.pid) if self._proc is not None else []

    async def stop(self) -> int | None:
        """Terminate the server's process group (SIGTERM, then SIGKILL); return its exit code."""
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)
            if not await _wait_exit(proc, STOP_GRACE_S):
                _signal_group(proc.pid, signal.SIGKILL)
                await _wait_exit(proc, STOP_GRACE_S)
        _signal_group(proc.pid, signal.SIGKILL)  # stragglers left in the group
        self._remove_rpc_dir()
        return proc.returncode

    def _remove_rpc_dir(self) -> None:
        rpc_dir, self._rpc_dir = self._rpc_dir, None
        if rpc_dir is not None:
            shutil.rmtree(rpc_dir, ignore_errors=True)

    def _bind_host(self) -> str:
        host = self._cfg.host
        return ray.util.get_node_ip_address() if host in ("0.0.0.0", "::") else host

    def _session(self) -> aiohttp.ClientSession:
        headers = bearer(self._api_key) if self._api_key else None
        return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10), headers=headers)

    def _launch(self, port: int) -> None:
        host = self._bind_host()
        self._base_url = f"http://{host}:{port}"
        cmd = build_command(self._cfg, self._model_path, port, host=host, auth=bool(self._api_key))
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self._log_path, "a", encoding="utf-8") as log:
            log.write(f"\n===== start {time.strftime('%Y-%m-%d %H:%M:%S')} port {port}: {' '.join(cmd)}\n")
            log.flush()
            self._log_offset = log.tell()
            self._remove_rpc_dir()
            self._rpc_dir = tempfile.mkdtemp(prefix=f"rollout-router-rpc{self._index}-")
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _DIE_WITH_PARENT, *cmd],
                env=build_env(self._cfg, self._index, api_key=self._api_key, rpc_dir=self._rpc_dir),
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    async def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self._cfg.startup_timeout_s
        async with self._session() as session:
            while True:
                if self._proc.poll() is not None:
                    code = await self.stop()
                    if _PORT_IN_USE in self._log_text().lower():
                        raise _PortTaken
                    raise RuntimeError(self._failure(f"exited with code {code}"))
                if await ops.is_healthy(session, self._base_url):
                    return
                if time.monotonic() > deadline:
                    await self.stop()
                    raise RuntimeError(self._failure(f"was not healthy after {self._cfg.startup_timeout_s:g} s"))
                await asyncio.sleep(HEALTH_POLL_S)

    def _log_text(self) -> str:
        with open(self._log_path, encoding="utf-8", errors="replace") as f:
            f.seek(self._log_offset)
            return f.read()

    def _failure(self, what: str) -> str:
        tail = "".join(deque(self._log_text().splitlines(keepends=True), maxlen=LOG_TAIL_LINES))
        return (f"vLLM replica {self._index} ({self._base_url}) {what}; "
                f"last {LOG_TAIL_LINES} lines of {self._log_path}:\n{tail}")


VllmReplicaActor = ray.remote(num_cpus=0)(VllmReplica)
"""``VllmReplica`` as a Ray actor: ``VllmReplicaActor.remote(cfg, index, model_path, log_dir)``."""


class _PortTaken(Exception):
    """The server lost its port to another process between ``free_port()`` and bind."""


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


async def _wait_exit(proc: subprocess.Popen, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.1)
    return True
