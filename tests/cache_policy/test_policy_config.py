"""PolicyConfig: defaults written once, validation names the field."""

from __future__ import annotations

import dataclasses
import math
import typing

import pytest
from hypothesis import given, settings, strategies as st

from cache_policy.config import PolicyConfig


def test_defaults() -> None:
    cfg = PolicyConfig()
    assert (cfg.balance_abs_threshold, cfg.balance_rel_threshold, cfg.cache_threshold) == (
        4,
        1.5,
        0.3,
    )
    assert (cfg.max_index_blocks, cfg.max_pins, cfg.move_queue_cost_tokens) == (
        200_000,
        100_000,
        256,
    )
    assert cfg.predicted_ttl_s == 10.0
    assert (cfg.high_watermark, cfg.max_queue, cfg.queue_timeout_s) == (0.85, 256, 30.0)
    assert cfg.session_idle_s == 120.0
    assert "max_in_flight_per_replica" in PolicyConfig.field_names()


def test_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        PolicyConfig().max_pins = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    "field, value",
    [
        ("balance_abs_threshold", -1),
        ("balance_rel_threshold", 0.9),
        ("cache_threshold", 1.5),
        ("cache_threshold", -0.1),
        ("max_index_blocks", 0),
        ("max_pins", 0),
        ("move_queue_cost_tokens", -1),
        ("predicted_ttl_s", 0.0),
        ("high_watermark", 0.0),
        ("high_watermark", 1.01),
        ("max_queue", -1),
        ("queue_timeout_s", 0.0),
        ("session_idle_s", -1.0),
        ("max_in_flight_per_replica", 0),
        ("parked_fraction", 1.5),
        ("session_fraction", -0.1),
        ("session_fraction", 1.01),
    ],
)
def test_invalid_field_raises_naming_it(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        PolicyConfig(**{field: value})


def test_edge_values_are_valid() -> None:
    PolicyConfig(
        balance_abs_threshold=0, balance_rel_threshold=1.0, cache_threshold=0.0, max_queue=0
    )
    PolicyConfig(cache_threshold=1.0, high_watermark=1.0)


def _fields_of(kind: type) -> list[str]:
    return [f.name for f in dataclasses.fields(PolicyConfig) if typing.get_type_hints(PolicyConfig)[f.name] is kind]


@settings(max_examples=100, deadline=None)
@given(
    field=st.sampled_from(_fields_of(int) + _fields_of(float)),
    value=st.one_of(st.booleans(), st.text(max_size=8), st.integers().map(str), st.none()),
)
def test_a_number_field_refuses_bools_and_strings_naming_it(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"PolicyConfig\.{field}: must be an? (integer|number), got "):
        PolicyConfig(**{field: value})


@pytest.mark.parametrize("field", _fields_of(float))
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_a_float_field_refuses_inf_and_nan(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=rf"PolicyConfig\.{field}: must be a finite number"):
        PolicyConfig(**{field: value})


def test_an_int_field_refuses_a_whole_float_and_a_float_field_takes_an_int() -> None:
    with pytest.raises(ValueError, match=r"PolicyConfig\.max_queue_per_replica: must be an integer, got 64\.0"):
        PolicyConfig(max_queue_per_replica=64.0)  # type: ignore[arg-type]
    cfg = PolicyConfig(queue_timeout_s=5, high_watermark=1)
    assert (cfg.queue_timeout_s, cfg.high_watermark) == (5.0, 1.0) and type(cfg.queue_timeout_s) is float
