"""The scoring cap S = P - 1, the block-rounded hit and the reuse bound (seed 000)."""

from __future__ import annotations

import pytest

from cache_policy.scoring import (
    PrefillCost,
    ScoringCap,
    cached_tokens_bound,
    flop_weighted_bound,
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


def test_prefill_cost_rows_sums_linear_plus_attention_per_position():
    cost = PrefillCost(linear_flops=10.0, attention_flops_per_key=3.0)
    for start, end in [(0, 0), (0, 1), (0, 7), (5, 9), (175, 905)]:
        want = sum(10.0 + 3.0 * (p + 1) for p in range(start, end))
        assert cost.rows(start, end) == want
    with pytest.raises(ValueError, match="start"):
        cost.rows(5, 4)


def test_llama_cost_counts_every_weight_matrix_twice():
    # hidden 8, 2 heads of 4, 1 KV head (GQA), MLP 16, 3 layers, vocab 50
    cost = PrefillCost.llama(hidden=8, intermediate=16, layers=3, heads=2, kv_heads=1, vocab=50)
    q, k, v, o = 8 * 8, 8 * 4, 8 * 4, 8 * 8
    gate, up, down = 8 * 16, 8 * 16, 16 * 8
    assert cost.linear_flops == 2 * (3 * (q + k + v + o + gate + up + down) + 8 * 50)
    assert cost.attention_flops_per_key == 3 * 2 * 2 * (2 * 4)  # layers * (QK + PV) * 2 FLOPs * q dims


def test_llama_cost_with_an_explicit_head_dim():
    # hidden 8 but one head of 2 (Q/O project 8 -> 2), 1 KV head, MLP 16, 1 layer, vocab 10
    cost = PrefillCost.llama(hidden=8, intermediate=16, layers=1, heads=1, kv_heads=1, vocab=10, head_dim=2)
    q, k, v, o = 8 * 2, 8 * 2, 8 * 2, 2 * 8
    assert cost.linear_flops == 2 * ((q + k + v + o + 3 * 8 * 16) + 8 * 10)
    assert cost.attention_flops_per_key == 2 * 2 * 2


def test_flop_weighted_bound_is_the_token_bound_without_attention_and_below_it_with():
    lens = [437, 600, 800, 1024]
    flat = PrefillCost(linear_flops=1.0, attention_flops_per_key=0.0)
    assert flop_weighted_bound(175, lens, flat) == pytest.approx(speedup_bound(175, lens))
    heavy = PrefillCost(linear_flops=1.0, attention_flops_per_key=0.01)
    by_hand = (sum(heavy.rows(0, 175 + r) for r in lens)
               / (heavy.rows(0, 175 + lens[0]) + sum(heavy.rows(175, 175 + r) for r in lens[1:])))
    assert flop_weighted_bound(175, lens, heavy) == pytest.approx(by_hand)
    assert 1.0 < flop_weighted_bound(175, lens, heavy) < speedup_bound(175, lens)


def test_reuse_costs_in_tokens_are_the_token_bounds_terms():
    from cache_policy.scoring import TOKEN_COST, reuse_costs

    lens = [13, 58, 30, 41]
    assert reuse_costs(3500, lens, TOKEN_COST) == (sum(3500 + r for r in lens), 3500 + sum(lens))
    uncached, reused = reuse_costs(3500, lens, TOKEN_COST)
    assert uncached / reused == pytest.approx(speedup_bound(3500, lens))
