"""The scoring cap S = P - 1, the block-rounded hit and the reuse bound (seed 000)."""

from __future__ import annotations

import pytest

from cache_policy.scoring import (
    ScoringCap,
    cached_tokens_bound,
    ideal_computed_tokens,
    scoring_cap,
    speedup_bound,
)


def test_cap_is_start_and_at_most_n_minus_1() -> None:
    assert scoring_cap(2048, 2100) == ScoringCap(2048, 2100, 2047, 2047)
    assert scoring_cap(1, 2) == ScoringCap(1, 2, 0, 0)
    assert scoring_cap(10, 11).cap_tokens == 9


@pytest.mark.parametrize(
    "cap, block, hit", [(2047, 32, 2016), (2047, 16, 2032), (31, 32, 0), (32, 32, 32), (0, 32, 0)]
)
def test_hit_rounds_down_to_a_block(cap: int, block: int, hit: int) -> None:
    assert cached_tokens_bound(cap, block) == hit


def test_seed_example_s_2047_block_32() -> None:
    cap = scoring_cap(context_len=2048, input_len=2048 + 30)
    assert cap.start == 2047
    assert cached_tokens_bound(cap.cap_tokens, 32) == 2016


def test_errors_name_the_knob() -> None:
    with pytest.raises(ValueError, match="context"):
        scoring_cap(0, 5)
    with pytest.raises(ValueError, match="responses"):
        scoring_cap(5, 5)
    with pytest.raises(ValueError, match="block_size"):
        cached_tokens_bound(10, 0)
    with pytest.raises(ValueError, match="responses"):
        speedup_bound(100, [])
    with pytest.raises(ValueError, match="responses"):
        speedup_bound(100, [10, 0])
    with pytest.raises(ValueError, match="context"):
        ideal_computed_tokens(0, [10], 32)
    with pytest.raises(ValueError, match="block_size"):
        ideal_computed_tokens(100, [10], 0)


def test_speedup_bound_seed_examples() -> None:
    assert speedup_bound(3500, [30] * 4) == 4 * 3530 / 3620
    assert speedup_bound(3500, [30] * 4) == pytest.approx(3.9, abs=0.01)
    assert speedup_bound(175, [730] * 4) == 4 * 905 / 3095
    assert speedup_bound(175, [730] * 4) == pytest.approx(1.17, abs=0.01)


def test_speedup_bound_unequal_responses_and_k1() -> None:
    assert speedup_bound(100, [10, 20, 30]) == (110 + 120 + 130) / (100 + 60)
    assert speedup_bound(100, [10]) == 1.0


def test_ideal_computed_tokens() -> None:
    # first request: 3530; each later: 3530 - floor(3499 / 32) * 32 = 3530 - 3488 = 42
    assert ideal_computed_tokens(3500, [30] * 4, 32) == 3530 + 3 * 42
    # P = 64 is block aligned, yet the hit stops at S = 63 -> one block (32) reused
    assert ideal_computed_tokens(64, [5, 7], 32) == 69 + (71 - 32)
    assert ideal_computed_tokens(20, [5, 5], 32) == 50  # context under a block: no reuse
    assert ideal_computed_tokens(100, [10], 32) == 110
