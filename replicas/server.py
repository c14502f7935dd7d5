"""One replica's vLLM OpenAI server: its command line and environment (pure helpers).

The actor (``replicas.actor``) runs what these build; nothing here starts a process.
"""

from __future__ import annotations

import json
import os
import tempfile
import socket
import sys
from pathlib import Path

from replicas.auth import KEY_ENV, MIDDLEWARE
from replicas.config import TINY_MODEL, ReplicaSetConfig, parse_cpu_list
from replicas.vllm_plugin.contract import INVARIANT_ATTENTION_ENV

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
LAUNCHER_DIR = Path(__file__).parent / "launcher"
"""Holds the ``sitecustomize`` every replica process runs first (see ``launcher/sitecustomize.py``)."""
DIE_WITH_PARENT_ENV = "ROLLOUT_ROUTER_DIE_WITH_PARENT"
"""Set in a replica's environment: its processes ask to be killed when their parent dies."""


def resolve_model(cfg: ReplicaSetConfig) -> str:
    """The model path to serve: the generated tiny Llama for ``"tiny"``, else ``cfg.model``."""
    if cfg.model != TINY_MODEL:
        return cfg.model
    from replicas.tiny_model import ensure_tiny_model

    return str(ensure_tiny_model())


def build_command(cfg: ReplicaSetConfig, model_path: str, port: int, *, host: str | None = None,
                  auth: bool = False) -> list[str]:
    """argv for one replica's OpenAI server on ``host`` (default ``cfg.host``) and ``port``.

    ``auth``: load :class:`replicas.auth.ReplicaAuthMiddleware` (``--middleware``), which then
    requires the key that :func:`build_env` puts in the environment on every non-health path.
    """
    cmd = [
        sys.executable, "-m", SERVER_MODULE,
        "--model", model_path,
        "--served-model-name", cfg.served_model_name,
        "--host", host or cfg.host,
        "--port", str(port),
        "--dtype", cfg.dtype,
        "--max-model-len", str(cfg.max_model_len),
        "--block-size", str(cfg.block_size),
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--no-enable-log-requests",  # 0.32 removed --disable-log-requests; off is the default
    ]
    if cfg.engine == "gpu":
        cmd += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
    if cfg.enforce_eager:
        cmd.append("--enforce-eager")
    if cfg.max_num_batched_tokens is not None:
        cmd += ["--max-num-batched-tokens", str(cfg.max_num_batched_tokens)]
    if cfg.max_num_seqs is not None:
        cmd += ["--max-num-seqs", str(cfg.max_num_seqs)]
    if auth:
        cmd += ["--middleware", MIDDLEWARE]
    return cmd + kv_events_args(cfg) + list(cfg.extra_args)


def kv_events_args(cfg: ReplicaSetConfig) -> list[str]:
    """``--kv-events-config``: publish KV cache events on a ZMQ PUB socket with a replay socket,
    both bound on OS-chosen ports of ``VLLM_HOST_IP`` (see ``replicas.kv_events``); none when
    ``cfg.extra_args`` configures events itself."""
    if any(a.startswith("--kv-events-config") for a in cfg.extra_args):
        return []
    from replicas.kv_events import TOPIC

    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:0",
              "replay_endpoint": "tcp://*:0", "topic": TOPIC}
    return ["--kv-events-config", json.dumps(config)]


def kv_events_host(cfg: ReplicaSetConfig) -> dict[str, str]:
    """``VLLM_HOST_IP`` = ``cfg.host`` unless it is a wildcard: the address the engine binds its
    KV event sockets on (a wildcard host leaves it to vLLM: the node's outward address)."""
    return {} if cfg.host in ("0.0.0.0", "::", "") else {"VLLM_HOST_IP": cfg.host}


FRONTEND_CPUS_ENV = "ROLLOUT_ROUTER_FRONTEND_CPUS"
"""Read (and removed) by the replica launcher shim in ``replicas/actor.py`` before it execs vLLM."""


def build_env(cfg: ReplicaSetConfig, index: int, base: dict[str, str] | None = None,
              api_key: str | None = None, rpc_dir: str | None = None) -> dict[str, str]:
    """Environment for replica ``index``: ``base`` (default ``os.environ``) plus our knobs.

    Every Python process of the replica (API server, engine core, workers) starts with
    ``replicas/launcher`` on ``PYTHONPATH``, whose ``sitecustomize`` makes it die with its
    parent (``PR_SET_PDEATHSIG``). ``api_key`` goes to ``KEY_ENV`` for the auth middleware.
    ``rpc_dir``: the replica's own temp folder (``TMPDIR``): vLLM's ZMQ ``ipc://`` socket files
    (``VLLM_RPC_BASE_PATH``, ``vllm/utils/network_utils.py`` ``get_open_zmq_ipc_path``) and its
    rendezvous file store (``get_file_store_init_method``: ``vllm_dist_<uuid>``) go there, not in
    the shared temp dir, where a killed engine leaves them (a few per start: 1,340 socket files
    and 240 stores found here), so whoever stops the replica removes them all with the folder.
    Torch's compile cache stays where it was (``TORCHINDUCTOR_CACHE_DIR``, the shared temp dir's
    ``torchinductor_<user>``), shared across launches. ``cfg.extra_env`` still wins.
    """
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(LAUNCHER_DIR), env.get("PYTHONPATH", "")]))
    env[DIE_WITH_PARENT_ENV] = "1"
    env.pop(KEY_ENV, None)
    if api_key:
        env[KEY_ENV] = api_key
    env["VLLM_SERVER_DEV_MODE"] = "1"  # /reset_prefix_cache, /collective_rpc, /pause, /resume
    env["PYTHONUNBUFFERED"] = "1"
    if rpc_dir is not None:
        env["VLLM_RPC_BASE_PATH"] = env["TMPDIR"] = rpc_dir
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", _inductor_cache_dir())
    if cfg.engine == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = _gib_str(cfg.kv_cache_space_gib)
        env["VLLM_CPU_OMP_THREADS_BIND"] = omp_threads_bind(cfg, index)
        if cfg.invariant_attention:
            env[INVARIANT_ATTENTION_ENV] = "1"
        if cfg.frontend_cpus:
            env[FRONTEND_CPUS_ENV] = ",".join(map(str, parse_cpu_list(cfg.frontend_cpus)))
    if not cfg.enable_plugin:
        env["VLLM_PLUGINS"] = ""
    env.update(kv_events_host(cfg))
    env.update(cfg.extra_env)
    return env


def _inductor_cache_dir() -> str:
    """Torch's default compile cache (``torch/_inductor/runtime/cache_dir_utils.py``
    ``default_cache_dir``), computed here, where the temp dir is still the shared one."""
    import getpass
    import re

    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def omp_threads_bind(cfg: ReplicaSetConfig, index: int, ncpu: int | None = None) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for replica ``index``.

    ``"auto"``: core ``index % ncpu``. Otherwise the value is split on ``|``, one part per
    replica (``"0|1"`` -> ``"0"``, ``"1"``; a single part is shared by all replicas).
    """
    if cfg.omp_threads_bind == "auto":
        return str(index % (ncpu or os.cpu_count() or 1))
    parts = cfg.omp_threads_bind.split("|")
    if len(parts) == 1:
        return parts[0]
    if index >= len(parts):
        raise ValueError(
            f"ReplicaSetConfig.omp_threads_bind {cfg.omp_threads_bind!r} has {len(parts)} parts "
            f"but replica {index} needs one; give one part per replica or use 'auto'"
        )
    return parts[index]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _gib_str(gib: float) -> str:
    return str(int(gib)) if float(gib).is_integer() else str(gib)
