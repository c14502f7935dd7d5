"""A replica's command line and environment: where it listens, its key, its launcher."""

from __future__ import annotations

from replicas.auth import KEY_ENV, MIDDLEWARE
from replicas.config import ReplicaSetConfig
from replicas.server import DIE_WITH_PARENT_ENV, LAUNCHER_DIR, build_command, build_env


def _flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_a_keyed_replica_loads_the_auth_middleware_and_gets_its_key_only_by_environment():
    cfg = ReplicaSetConfig()
    cmd = build_command(cfg, "/m", 8001, host="10.1.2.3", auth=True)
    assert _flag(cmd, "--middleware") == MIDDLEWARE and _flag(cmd, "--host") == "10.1.2.3"
    env = build_env(cfg, 0, base={"PYTHONPATH": "/x", KEY_ENV: "inherited"}, api_key="k" * 43)
    assert env[KEY_ENV] == "k" * 43 and "k" * 43 not in " ".join(cmd)
    assert env["PYTHONPATH"] == f"{LAUNCHER_DIR}:/x" and env[DIE_WITH_PARENT_ENV] == "1"


def test_an_unkeyed_replica_has_no_middleware_and_no_inherited_key():
    cfg = ReplicaSetConfig()
    cmd = build_command(cfg, "/m", 8001)
    assert "--middleware" not in cmd and _flag(cmd, "--host") == cfg.host
    assert KEY_ENV not in build_env(cfg, 0, base={KEY_ENV: "inherited"})


def test_a_replicas_temp_files_go_in_its_own_folder_and_the_compile_cache_stays_shared():
    import tempfile

    cfg = ReplicaSetConfig()
    env = build_env(cfg, 0, base={}, rpc_dir="/tmp/rollout-router-rpc0-x")
    assert env["TMPDIR"] == env["VLLM_RPC_BASE_PATH"] == "/tmp/rollout-router-rpc0-x"
    assert env["TORCHINDUCTOR_CACHE_DIR"].startswith(tempfile.gettempdir() + "/torchinductor_")
    assert build_env(cfg, 0, base={"TORCHINDUCTOR_CACHE_DIR": "/c"}, rpc_dir="/r")["TORCHINDUCTOR_CACHE_DIR"] == "/c"
    assert "TMPDIR" not in build_env(cfg, 0, base={})
