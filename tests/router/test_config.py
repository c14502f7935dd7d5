"""Config files are checked against the dataclasses: unknown keys name themselves."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.config import AppConfig, RouterConfig

ROOT = Path(__file__).resolve().parents[2]


def test_local_yaml_loads_two_cpu_replicas_of_the_tiny_model():
    cfg = AppConfig.load(ROOT / "configs" / "local.yaml")
    assert cfg.replicas.model == "tiny" and cfg.replicas.num_replicas == 2 and cfg.replicas.engine == "cpu"
    assert cfg.router.state == "memory"


def test_unknown_keys_and_sections_are_named(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("router:\n  prot: 9000\n")
    with pytest.raises(ValueError, match="prot"):
        AppConfig.load(bad)
    bad.write_text("routers: {}\n")
    with pytest.raises(ValueError, match="routers"):
        AppConfig.load(bad)


def test_replace_overrides_one_field_and_validates():
    cfg = AppConfig().replace(router={"port": 0, "policy": "round_robin"})
    assert cfg.router.port == 0 and cfg.router.policy == "round_robin" and cfg.replicas.num_replicas == 2
    with pytest.raises(ValueError, match="port"):
        RouterConfig(port=70000)
    with pytest.raises(ValueError, match="redis_url"):
        RouterConfig(state="redis")


def test_unknown_policy_is_rejected_before_anything_starts():
    with pytest.raises(ValueError, match="round_robin"):
        RouterConfig(policy="bogus")
