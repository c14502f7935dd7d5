"""Fixtures for the vLLM plugin tests: two real vLLM-CPU OpenAI servers, driven over HTTP.

Both servers run the tiny model with the same engine flags and are started concurrently, once
per test module, the first time a test asks for one (about a minute on 2 cores):

* ``capped_server``: the plugin loaded (the entry point in ``pyproject.toml``), test hooks on
  (``ROLLOUT_ROUTER_PLUGIN_TEST_HOOKS=1``, see ``replicas/vllm_plugin/testing_hooks.py``) and
  chunk-invariant attention on (``ReplicaSetConfig.invariant_attention``, the default);
* ``disabled_server``: ``VLLM_PLUGINS=""``, so no general plugin loads.

Engine flags: 32-token blocks, chunked prefill of 256 tokens a step, and a KV cache of only
96 blocks (3,072 tokens, ``--num-gpu-blocks-override``) so that a burst of long requests forces
preemption. ``VLLM_SERVER_DEV_MODE=1`` enables ``/reset_prefix_cache``.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import pytest

from replicas.config import ReplicaSetConfig
from tests.replicas.vllm_server import HttpResult, VllmServer

__all__ = ["BLOCK_SIZE", "HttpResult", "VllmServer"]

BLOCK_SIZE = 32
NUM_BLOCKS = 96
STEP_TOKENS = 256
ENGINE = ReplicaSetConfig(
    served_model_name="tiny-plugin", max_model_len=2560, block_size=BLOCK_SIZE, kv_cache_space_gib=1.0,
    max_num_batched_tokens=STEP_TOKENS, max_num_seqs=16, startup_timeout_s=600.0,
    extra_args=("--enable-chunked-prefill", "--num-gpu-blocks-override", str(NUM_BLOCKS)),
)
"""Both servers' engine: the replica launcher's flags plus a 256-token step and 96 blocks."""


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
    capped = replace(ENGINE, omp_threads_bind=f"0|{1 % ncpu}", extra_env={"ROLLOUT_ROUTER_PLUGIN_TEST_HOOKS": "1"})
    disabled = replace(capped, enable_plugin=False, extra_env={})
    servers = PluginServers(capped=VllmServer("capped", capped, model, log_dir, index=0),
                            disabled=VllmServer("disabled", disabled, model, log_dir, index=1))
    try:
        with ThreadPoolExecutor(2) as pool:
            for f in [pool.submit(s.wait_healthy, ENGINE.startup_timeout_s) for s in (servers.capped, servers.disabled)]:
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
