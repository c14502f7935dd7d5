"""The routers under test: how each one is started and which routing-key header it reads.

* ours: ``rollout-router serve`` with ``replicas.urls`` (wraps the servers, launches nothing);
  keys ``X-Session-Id`` (agent turns, ``X-Session-End`` on the last) and ``X-Group-Id`` (GRPO).
* vllm-router 0.1.17 (``--policy``): ``consistent_hash`` and ``sticky_least_loaded`` read the first
  non-empty of ``x-session-id``, ``x-user-id``, ... (``src/policies/hash_key.rs``
  ``SESSION_HEADER_NAMES``); we send the session or group id as ``x-session-id``.
* sglang-router 0.3.2: ``consistent_hashing`` reads ``x-smg-routing-key`` (the header name in its
  binary, next to ``x-smg-target-worker``). Its CLI's ``--policy`` choices omit ``consistent_hashing``
  though the Rust core has it (``sglang_router.router.policy_from_str``), so it starts through
  ``bench.h2h.sglang_launch``, which sets the policy after parsing. Its ``/v1/completions`` refuses
  token-ID prompts (a list of ints is not its ``StringOrArray``), so it gets the same IDs spelled as
  text (``bench.h2h.server.spell_ids``), which the replicas tokenize back exactly.

Rust routers run from a separate venv (``--rust-venv``, default ``.venv-h2h``): they are not
project dependencies.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterable
from typing import Any

import aiohttp
import yaml

from bench.h2h.server import spell_ids

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class RouterSpec:
    """One router and policy: ``kind`` in ours | vllm | sglang; ``key_header``: where the routing key goes."""

    name: str
    kind: str
    policy: str
    key_header: str | None
    text_prompts: bool = False
    """Token IDs go as spelled-out text (``bench.h2h.server.spell_ids``): its /v1/completions takes text only."""
    settings: tuple[tuple[str, Any], ...] = ()
    """Ours: config settings on top of the defaults, as ``("section.key", value)``."""
    workloads: bool = True
    """Run the workloads through it (False: the latency run only: a floor, or a setting that
    changes no routing decision)."""

    def prompt(self, token_ids: list[int]) -> list[int] | str:
        """The ``prompt`` field this router is sent for ``token_ids``."""
        return spell_ids(token_ids) if self.text_prompts else token_ids

    def headers(self, session_id: str | None, group_id: str | None, ends_session: bool = False) -> dict[str, str]:
        """The headers that carry a request's routing key to this router."""
        if self.kind == "ours":
            h = {"X-Session-Id": session_id} if session_id else {"X-Group-Id": group_id} if group_id else {}
            if session_id and ends_session:
                h["X-Session-End"] = "true"
            return h
        key = session_id or group_id
        return {self.key_header: key} if key and self.key_header else {}


ALL = [
    RouterSpec("ours", "ours", "default", None),
    RouterSpec("ours busy_poll_ms=50", "ours", "default", None, settings=(("router.busy_poll_ms", 50),),
               workloads=False),
    RouterSpec("vllm-router cache_aware", "vllm", "cache_aware", None),
    RouterSpec("vllm-router consistent_hash", "vllm", "consistent_hash", "x-session-id"),
    RouterSpec("vllm-router sticky_least_loaded", "vllm", "sticky_least_loaded", "x-session-id"),
    RouterSpec("vllm-router round_robin", "vllm", "round_robin", None),
    RouterSpec("sglang-router cache_aware", "sglang", "cache_aware", None, True),
    RouterSpec("sglang-router consistent_hashing", "sglang", "consistent_hashing", "x-smg-routing-key", True),
    RouterSpec("sglang-router round_robin", "sglang", "round_robin", None, True),
    RouterSpec("aiohttp pass-through", "floor", "round_robin", None, workloads=False),
]
"""``aiohttp pass-through`` (``bench.h2h.passthrough``) is the latency run's floor for a Python
router, not a router under test: no workload runs through it."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nested(settings: Iterable[tuple[str, Any]]) -> dict[str, dict[str, Any]]:
    """Dotted config settings as YAML sections: ``[("router.port", 1)]`` -> ``{"router": {"port": 1}}``."""
    out: dict[str, dict[str, Any]] = {}
    for key, value in settings:
        section, _, name = key.partition(".")
        out.setdefault(section, {})[name] = value
    return out


def command(spec: RouterSpec, urls: list[str], port: int, rust_venv: Path, workdir: Path) -> list[str]:
    """The argv that starts ``spec`` on ``port`` in front of ``urls``."""
    if spec.kind == "ours":
        cfg = nested([("replicas.urls", list(urls)), *spec.settings])
        path = workdir / f"ours-{port}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return [sys.executable, "-m", "router", "serve", "--config", str(path), "--host", "127.0.0.1",
                "--port", str(port)]
    if spec.kind == "floor":
        return [sys.executable, "-m", "bench.h2h.passthrough", "--port", str(port), *urls]
    py = str(rust_venv / "bin" / "python")
    if spec.kind == "vllm":
        return [str(rust_venv / "bin" / "vllm-router"), "--host", "127.0.0.1", "--port", str(port),
                "--worker-urls", *urls, "--policy", spec.policy, "--log-level", "warning",
                "--prometheus-port", str(free_port())]
    return [py, "-m", "bench.h2h.sglang_launch", spec.policy, "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *urls, "--log-level", "warn", "--prometheus-port", str(free_port())]


class RunningRouter:
    """A router process; ``async with`` starts it and waits until it routes, then stops it (SIGTERM)."""

    def __init__(self, spec: RouterSpec, urls: list[str], rust_venv: Path, log_dir: Path,
                 startup_s: float = 60.0) -> None:
        self.spec, self.urls, self.rust_venv, self.log_dir, self.startup_s = spec, urls, rust_venv, log_dir, startup_s
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    async def __aenter__(self) -> RunningRouter:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        argv = command(self.spec, self.urls, self.port, self.rust_venv, Path(tempfile.mkdtemp(prefix="h2h-")))
        log = open(self.log_dir / f"{self.spec.name.replace(' ', '_')}.log", "ab")
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        log.close()
        try:
            await self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        self.stop()

    async def _wait_ready(self) -> None:
        """Until a one-block token-ID completion comes back 200 (health alone can precede routing)."""
        body = {"model": "sim-model", "prompt": self.spec.prompt(list(range(10, 30))), "max_tokens": 1}
        deadline = asyncio.get_running_loop().time() + self.startup_s
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.spec.name} exited with {self.proc.returncode} (log in {self.log_dir})")
                try:
                    async with http.post(f"{self.url}/v1/completions", json=body) as r:
                        if r.status == 200:
                            return
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    pass
                if asyncio.get_running_loop().time() > deadline:
                    raise RuntimeError(f"{self.spec.name} did not route within {self.startup_s:g} s")
                await asyncio.sleep(0.25)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s (its own process group only)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
