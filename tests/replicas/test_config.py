"""ReplicaSetConfig validation, YAML loading, and the server command line / env built from it."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest
import yaml

from replicas.config import ReplicaSetConfig
from replicas.server import build_command, build_env, free_port, omp_threads_bind

LOCAL_YAML = Path(__file__).parents[2] / "configs" / "local.yaml"


def test_defaults_are_the_embedded_local_setup():
    cfg = ReplicaSetConfig()
    assert (cfg.model, cfg.num_replicas, cfg.engine, cfg.block_size) == ("tiny", 2, "cpu", 32)
    assert cfg.urls == () and cfg.extra_env == {} and cfg.replica_count == 2


@pytest.mark.parametrize(
    ("kwargs", "field_name"),
    [
        ({"engine": "tpu"}, "engine"),
        ({"num_replicas": 0}, "num_replicas"),
        ({"block_size": 16}, "block_size"),
        ({"block_size": 0}, "block_size"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"kv_cache_space_gib": 0}, "kv_cache_space_gib"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"max_num_seqs": -1}, "max_num_seqs"),
        ({"startup_timeout_s": 0}, "startup_timeout_s"),
        ({"urls": ("localhost:8000",)}, "urls"),
        ({"model": ""}, "model"),
    ],
)
def test_invalid_values_name_the_field(kwargs, field_name):
    with pytest.raises(ValueError, match=rf"ReplicaSetConfig\.{field_name}\b"):
        ReplicaSetConfig(**kwargs)


def test_gpu_engine_allows_any_block_size():
    assert ReplicaSetConfig(engine="gpu", block_size=16).block_size == 16


def test_wrapped_servers_skip_the_cpu_launch_rule_for_block_size():
    """With urls nothing is launched: a GPU fleet's 16 (the servers report it) is no config error."""
    assert ReplicaSetConfig(urls=("http://127.0.0.1:8100",), block_size=16).block_size == 16
    with pytest.raises(ValueError, match=r"ReplicaSetConfig\.block_size: must be a multiple of 32"):
        ReplicaSetConfig(block_size=16)


def test_from_dict_rejects_unknown_keys_by_name():
    with pytest.raises(ValueError, match=r"\['num_replica', 'port'\]"):
        ReplicaSetConfig.from_dict({"num_replica": 3, "port": 1, "model": "tiny"})


def test_from_dict_converts_yaml_lists():
    cfg = ReplicaSetConfig.from_dict({"urls": ["http://a:1/", "http://b:2"], "extra_args": ["--seed", "3"],
                                      "extra_env": {"X": 1}})
    assert cfg.urls == ("http://a:1", "http://b:2") and cfg.replica_count == 2
    assert cfg.extra_args == ("--seed", "3") and cfg.extra_env == {"X": "1"}


def test_local_yaml_replicas_section_matches_the_dataclass():
    doc = yaml.safe_load(LOCAL_YAML.read_text())
    assert set(doc) == {"router", "replicas", "policy"}
    assert set(doc["replicas"]) == {f.name for f in fields(ReplicaSetConfig)}
    assert ReplicaSetConfig.from_dict(doc["replicas"]) == ReplicaSetConfig()


def test_command_carries_the_required_flags():
    cmd = build_command(ReplicaSetConfig(max_num_seqs=8, extra_args=("--seed", "1")), "/m", 1234)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(cmd)
    for flag in ("--model /m", "--port 1234", "--host 127.0.0.1", "--block-size 32", "--max-model-len 16384",
                 "--dtype float32", "--served-model-name tiny-llama", "--enable-prefix-caching",
                 "--enable-prompt-tokens-details", "--enforce-eager", "--max-num-seqs 8"):
        assert flag in joined, flag
    assert cmd[-2:] == ["--seed", "1"]
    assert "--gpu-memory-utilization" not in cmd and "--max-num-batched-tokens" not in cmd


def test_env_sets_dev_mode_kv_space_binding_and_plugin_switch():
    env = build_env(ReplicaSetConfig(kv_cache_space_gib=2, omp_threads_bind="0|1"), 1, base={"PATH": "/bin"})
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["PATH"] == "/bin"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert "VLLM_PLUGINS" not in env
    off = build_env(ReplicaSetConfig(enable_plugin=False, extra_env={"VLLM_CPU_KVCACHE_SPACE": "3"}), 0, base={})
    assert off["VLLM_PLUGINS"] == "" and off["VLLM_CPU_KVCACHE_SPACE"] == "3"


def test_invariant_attention_is_on_by_default_on_cpu_only():
    assert build_env(ReplicaSetConfig(), 0, base={})["ROLLOUT_ROUTER_INVARIANT_ATTENTION"] == "1"
    assert "ROLLOUT_ROUTER_INVARIANT_ATTENTION" not in build_env(
        ReplicaSetConfig(invariant_attention=False), 0, base={})
    assert "ROLLOUT_ROUTER_INVARIANT_ATTENTION" not in build_env(ReplicaSetConfig(engine="gpu"), 0, base={})


def test_omp_binding_auto_wraps_cores_and_explicit_parts_must_cover_replicas():
    assert [omp_threads_bind(ReplicaSetConfig(), i, ncpu=2) for i in range(3)] == ["0", "1", "0"]
    assert omp_threads_bind(ReplicaSetConfig(omp_threads_bind="0-3"), 5) == "0-3"
    with pytest.raises(ValueError, match="omp_threads_bind"):
        omp_threads_bind(ReplicaSetConfig(omp_threads_bind="0|1"), 2)


def test_free_port_is_bindable():
    import socket

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_frontend_cpus_parse_and_bad_values_name_the_field():
    from replicas.config import parse_cpu_list

    assert parse_cpu_list("") == [] and parse_cpu_list("1") == [1] and parse_cpu_list("0-2,5") == [0, 1, 2, 5]
    for bad in ("x", "3-1", "1-", "-2"):
        with pytest.raises(ValueError, match="frontend_cpus"):
            ReplicaSetConfig(frontend_cpus=bad)


def test_server_urls_are_kept_in_one_spelling_and_one_server_named_twice_is_refused():
    assert ReplicaSetConfig(urls=(" HTTP://Node-A:8000/ ", "http://node-b:80/v1/")).urls == (
        "http://node-a:8000", "http://node-b/v1")
    for urls, says in [(("http://a:1", "http://A:1/"), "more than once"), (("http://u:pw@a:1",), "credentials"),
                       (("ftp://a:1",), "http(s)"), (("http://a:1?x=1",), "query")]:
        with pytest.raises(ValueError, match="urls") as err:
            ReplicaSetConfig(urls=urls)
        assert says in str(err.value)
