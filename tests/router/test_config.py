"""Config files are checked against the dataclasses: unknown keys name themselves."""

from __future__ import annotations

import dataclasses
import math
import typing
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from cache_policy.config import PolicyConfig
from replicas.config import ReplicaSetConfig
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


@pytest.mark.parametrize("yaml_text,message", [
    ("replicas:\n  kv_cache_space_gib: 1.5\n", "replicas.kv_cache_space_gib: must be a whole number of GiB, got 1.5"),
    ("replicas:\n  dtype: fp8\n", "replicas.dtype: must be one of 'auto', 'half', 'float16', 'bfloat16', 'float' "
                                  "or 'float32', got 'fp8'"),
    ("replicas:\n  urls: 3\n", "replicas.urls: must be a list, got 3"),
    ("router:\n  port: eighty\n", "router.port: must be an integer, got 'eighty'"),
    ("router:\n  weight_update_mode: canary\n", "router.weight_update_mode: must be one of 'rolling' or 'all', "
                                                "got 'canary'"),
    ("router:\n  max_n: 0\n", "router.max_n: must be >= 1, got 0"),
    ("router:\n  busy_poll_ms: -1\n", "router.busy_poll_ms: must be in [0, 60000] milliseconds (0: off), got -1.0"),
    ("router:\n  busy_poll_ms: .nan\n", "router.busy_poll_ms: must be a finite number, got nan"),
    ("router:\n  api_keys: [a]\n", "router.api_keys: must be a mapping, got ('a',)"),
    ("policy:\n  high_watermark: 2\n", "policy.high_watermark: must be in (0, 1], got 2.0"),
    ("policy:\n  max_queue: many\n", "policy.max_queue: must be an integer, got 'many'"),
    ("router: 3\n", "router: must be a mapping of settings, got 3"),
    # strict numbers: no bools or strings (an int is a float), finite floats only
    ("policy:\n  max_queue_per_replica: true\n", "policy.max_queue_per_replica: must be an integer, got True"),
    ("policy:\n  max_queue_per_replica: '64'\n", "policy.max_queue_per_replica: must be an integer, got '64'"),
    ("policy:\n  max_queue_per_replica: 64.0\n", "policy.max_queue_per_replica: must be an integer, got 64.0"),
    ("policy:\n  queue_timeout_s: .inf\n", "policy.queue_timeout_s: must be a finite number, got inf"),
    ("policy:\n  queue_timeout_s: .nan\n", "policy.queue_timeout_s: must be a finite number, got nan"),
    ("policy:\n  queue_timeout_s: '30'\n", "policy.queue_timeout_s: must be a number, got '30'"),
    ("router:\n  request_timeout_s: false\n", "router.request_timeout_s: must be a number, got False"),
    ("router:\n  max_staleness: yes\n", "router.max_staleness: must be an integer, got True"),
    ("replicas:\n  startup_timeout_s: -.inf\n", "replicas.startup_timeout_s: must be a finite number, got -inf"),
    ('{"policy": {"max_queue_per_replica": true}}\n', "policy.max_queue_per_replica: must be an integer, got True"),
])
def test_a_bad_value_is_one_line_naming_its_yaml_path(tmp_path, yaml_text, message):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml_text)
    with pytest.raises(ValueError) as err:
        AppConfig.load(bad)
    assert str(err.value) == message and "\n" not in str(err.value)


def test_invalid_yaml_is_one_line_too(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("router: [1\n")
    with pytest.raises(ValueError, match=r"bad\.yaml is not valid YAML") as err:
        AppConfig.load(bad)
    assert "\n" not in str(err.value)


def test_edge_fields_and_their_derived_defaults():
    cfg = AppConfig()
    assert (cfg.max_model_len, cfg.max_prompt_chars) == (16384, 16 * 16384)
    assert cfg.router.api_keys == {} and not cfg.router.tenant_header and cfg.router.expose_expected_cached_tokens
    cfg = AppConfig().replace(router={"max_model_len": 4096, "api_keys": {"k": "team"}})
    assert (cfg.max_model_len, cfg.max_prompt_chars, cfg.router.api_keys) == (4096, 65536, {"k": "team"})
    with pytest.raises(ValueError, match=r"^router\.body_timeout_s: must be > 0 seconds, got 0.0$"):
        AppConfig().replace(router={"body_timeout_s": 0})
    with pytest.raises(ValueError, match=r"^replicas\.kv_cache_space_gib: must be a whole number of GiB, got 0\.5$"):
        AppConfig().replace(replicas={"kv_cache_space_gib": 0.5})


def test_choice_lists_come_from_their_owners():
    import typing

    from cache_policy.policy import POLICIES
    from cache_policy.salts import WEIGHT_UPDATE_POLICIES
    from replicas.weights import PAUSE_MODES
    from router.config import RouterConfig as R

    hints = typing.get_type_hints(R)
    assert set(typing.get_args(hints["policy"])) == set(POLICIES)
    assert typing.get_args(hints["weight_update_policy"]) == WEIGHT_UPDATE_POLICIES
    assert typing.get_args(hints["weight_update_pause_mode"]) == PAUSE_MODES


def test_every_shipped_config_loads():
    paths = sorted((ROOT / "configs").glob("*.yaml"))
    assert paths
    for path in paths:
        AppConfig.load(path)


def _number_fields(kind: type) -> list[tuple[str, str, object]]:
    """(YAML section, field, default) of every ``kind`` field (``int | None`` included) of the three sections."""
    out = []
    for section, cls in (("router", RouterConfig), ("replicas", ReplicaSetConfig), ("policy", PolicyConfig)):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if kind in (typing.get_args(hints[f.name]) or (hints[f.name],)):
                out.append((section, f.name, f.default))
    return out


INT_FIELDS, FLOAT_FIELDS = _number_fields(int), _number_fields(float)


def test_the_number_fields_are_found():
    assert ("policy", "max_queue_per_replica", 64) in INT_FIELDS and ("router", "max_staleness", None) in INT_FIELDS
    assert ("policy", "queue_timeout_s", 30.0) in FLOAT_FIELDS and len(FLOAT_FIELDS) >= 15


_BAD_NUMBERS = st.one_of(
    st.tuples(st.sampled_from(INT_FIELDS + FLOAT_FIELDS),
              st.one_of(st.booleans(), st.text(max_size=8), st.integers().map(str))),
    st.tuples(st.sampled_from(FLOAT_FIELDS), st.sampled_from([math.inf, -math.inf, math.nan])),
)
"""(field, value): a bool or a string for any number field, or inf/nan for a float field."""


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_BAD_NUMBERS)
def test_a_bad_number_is_refused_naming_its_field(tmp_path, case):
    (section, name, _), value = case
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({section: {name: value}}))
    reason = "must be a finite number, got " if isinstance(value, float) else ""
    with pytest.raises(ValueError, match=rf"^{section}\.{name}: {reason}"):
        AppConfig.load(path)


@pytest.mark.parametrize("section,name,default", FLOAT_FIELDS)
def test_an_integer_is_still_a_number(tmp_path, section, name, default):
    value = int(default) if default.is_integer() else 1  # 1 is valid for each fractional default
    path = tmp_path / "c.yaml"
    path.write_text(f"{section}:\n  {name}: {value}\n")
    loaded = getattr(getattr(AppConfig.load(path), section), name)
    assert loaded == value and type(loaded) is float


def test_the_idle_timeout_outlasts_the_clients_keep_alive_pools():
    # a server closing an idle connection as a client reuses it fails that request with a
    # disconnect the client does not retry (aiohttp #2682): the router must keep idle connections
    # longer than the pools of the clients RL stacks use (read from the libraries themselves)
    import asyncio

    import aiohttp
    import httpx

    from router.config import RouterConfig

    async def aiohttp_pool_s() -> float:
        connector = aiohttp.TCPConnector()
        try:
            return connector._keepalive_timeout
        finally:
            await connector.close()

    pools = {"aiohttp": asyncio.run(aiohttp_pool_s()), "httpx": httpx.Limits().keepalive_expiry}
    assert all(RouterConfig().header_timeout_s > s for s in pools.values()), pools
