"""One real vLLM server process for a test module, launched the way ``replicas`` launches one.

Used by the plugin engine tests (``conftest.py``) and the weight-update tests; the HTTP helpers
are synchronous (urllib) so tests read as plain request/response sequences.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replicas.config import ReplicaSetConfig
from replicas.server import build_command, build_env, free_port
from replicas.vllm_plugin import SCORE_START_KEY


@dataclass
class HttpResult:
    status: int
    body: dict

    @property
    def choice(self) -> dict:
        return self.body["choices"][0]

    @property
    def cached_tokens(self) -> int:
        return self.body["usage"]["prompt_tokens_details"]["cached_tokens"]


class VllmServer:
    """One vLLM OpenAI server process on loopback, launched exactly as ``replicas`` launches a
    replica (:func:`replicas.server.build_command` / :func:`~replicas.server.build_env`) but
    without Ray, so a test module can own it. ``index`` picks the core (``omp_threads_bind``)."""

    def __init__(self, name: str, cfg: ReplicaSetConfig, model: str | Path, log_dir: Path, index: int = 0):
        self.name = name
        self.cfg = cfg
        self.port = free_port(cfg.host)
        self.base = f"http://{cfg.host}:{self.port}"
        self.log_path = log_dir / f"{name}.log"
        self.rpc_dir = tempfile.mkdtemp(prefix=f"rollout-router-rpc-{name}-")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(build_command(cfg, str(model), self.port),
                                         env=build_env(cfg, index, rpc_dir=self.rpc_dir),
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} server exited ({self.proc.returncode}); see {self.log_path}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(2)
        raise TimeoutError(f"{self.name} server not healthy after {timeout_s} s; see {self.log_path}")

    def start(self, timeout_s: float | None = None) -> "VllmServer":
        """Wait for ``/health`` (``cfg.startup_timeout_s`` by default); stop the process on failure."""
        try:
            self.wait_healthy(timeout_s or self.cfg.startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        shutil.rmtree(self.rpc_dir, ignore_errors=True)

    # -- HTTP ------------------------------------------------------------------------------
    def post(self, path: str, body: dict, timeout_s: float = 300) -> HttpResult:
        req = urllib.request.Request(self.base + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                return HttpResult(r.status, json.loads(r.read() or b"{}"))
        except urllib.error.HTTPError as e:
            return HttpResult(e.code, json.loads(e.read() or b"{}"))

    def score(self, token_ids: list[int], score_start: int | None = None, *, logprobs: int = 0,
              max_tokens: int = 1, xargs: dict | None = None) -> HttpResult:
        """A scoring request: ``prompt_logprobs`` over token ids, with S in ``vllm_xargs``."""
        body: dict[str, Any] = {"model": self.cfg.served_model_name, "prompt": token_ids, "max_tokens": max_tokens,
                                "temperature": 0, "prompt_logprobs": logprobs}
        extra = dict(xargs or {})
        if score_start is not None:
            extra[SCORE_START_KEY] = score_start
        if extra:
            body["vllm_xargs"] = extra
        return self.post("/v1/completions", body)

    def generate(self, token_ids: list[int], max_tokens: int) -> HttpResult:
        return self.post("/v1/completions", {"model": self.cfg.served_model_name, "prompt": token_ids, "temperature": 0,
                                             "max_tokens": max_tokens, "ignore_eos": True})

    def reset_prefix_cache(self) -> None:
        assert self.post("/reset_prefix_cache", {}).status == 200

    def metrics_text(self) -> str:
        with urllib.request.urlopen(self.base + "/metrics", timeout=30) as r:
            return r.read().decode()

    def metric(self, name: str) -> float:
        """Sum of a metric's samples over all label sets (0 when absent)."""
        pattern = r"^" + re.escape(name) + r"(?:\{[^}]*\})? ([0-9.eE+-]+)$"
        return sum(float(m.group(1)) for m in re.finditer(pattern, self.metrics_text(), re.M))
