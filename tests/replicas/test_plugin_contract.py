"""The scoring contract (S, the cap) and the front end's row alignment: pure, no vLLM."""

from __future__ import annotations

import pytest

from replicas.vllm_plugin import SCORE_START_KEY
from replicas.vllm_plugin.contract import (
    SCORE_START_FIELD,
    ScoreStartError,
    block_rounded_hit,
    resolve_cap,
    score_start_of,
    validate_score_start,
)
from replicas.vllm_plugin.prompt_rows import rows_to_drop_and_pad


def test_key_and_field_names():
    assert SCORE_START_KEY == "rollout_router_score_start"
    assert SCORE_START_FIELD == "vllm_xargs.rollout_router_score_start"
    assert score_start_of({SCORE_START_KEY: 7, "other": 1}) == 7
    assert score_start_of(None) is None
    assert score_start_of({"other": 1}) is None


@pytest.mark.parametrize("s, n", [(0, 2), (1999, 2001), (2047, 2100), (5, 7)])
def test_valid_score_start_is_returned(s, n):
    assert validate_score_start(s, n) == s


@pytest.mark.parametrize(
    "value, n, needle",
    [
        (-1, 100, ">= 0"),
        (2.0, 100, "must be an integer"),
        ("7", 100, "must be an integer"),
        (True, 100, "must be an integer"),
        (None, 100, "must be an integer"),
        (99, 100, "<= N - 2 = 98"),  # S = N - 1: no response token left
        (150, 100, "leaves no scored row"),
        (0, 1, "<= N - 2 = -1"),  # a one-token input has no row at all
    ],
)
def test_invalid_score_start_names_the_field(value, n, needle):
    with pytest.raises(ScoreStartError) as e:
        validate_score_start(value, n)
    assert SCORE_START_FIELD in str(e.value)
    assert needle in str(e.value)


def test_cap_is_min_of_s_and_n_minus_one():
    assert resolve_cap(1999, 2100) == 1999
    assert resolve_cap(5000, 2100) == 2099


@pytest.mark.parametrize(
    "cap, block, hit", [(2047, 32, 2016), (2047, 16, 2032), (1999, 32, 1984), (31, 32, 0), (64, 32, 64)]
)
def test_hit_rounds_down_to_a_block(cap, block, hit):
    assert block_rounded_hit(cap, block) == hit


@pytest.mark.parametrize(
    "num_rows, s, incoming, drop, pad",
    [
        (2099, 1999, 2099, 1999, 1999),  # the whole buffer: cut rows before S
        (2099, 1999, 100, 0, 1999),  # rows from S only (what the engine core sends)
        (2099, 1999, 2099 - 1984, 15, 1999),  # rows from a 1984-token hit (V2 without padding)
        (2099, 1999, 50, 0, 2049),  # a piece starting after S: the gap stays None
        (10, 0, 10, 0, 0),  # S = 0: every row is scored
    ],
)
def test_rows_align_to_absolute_entries(num_rows, s, incoming, drop, pad):
    assert rows_to_drop_and_pad(num_rows, s, 0, incoming) == (drop, pad)
    assert pad + incoming - drop == num_rows  # the list ends up with N entries


def test_later_pieces_are_appended_unchanged():
    assert rows_to_drop_and_pad(2099, 1999, 100, 20) == (0, 0)


def test_detokenize_flag_is_read_only_when_false():
    from replicas.vllm_plugin.contract import DETOKENIZE_KEY, skips_detokenize

    assert skips_detokenize({DETOKENIZE_KEY: False}) and skips_detokenize({DETOKENIZE_KEY: 0})
    assert not skips_detokenize({DETOKENIZE_KEY: True}) and not skips_detokenize({DETOKENIZE_KEY: 1})
    assert not skips_detokenize(None) and not skips_detokenize({}) and not skips_detokenize({"other": False})
