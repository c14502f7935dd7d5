"""The scoring cap and the bound on what prefix reuse can save (DESIGN rule 5, seed 000).

A scoring request sends context (``P`` tokens) + response, ``N`` tokens in all, and asks
for per-position scores from ``S = P - 1`` on: the output at the last context position
predicts the first response token. The prefix cache stores keys/values, not logits, so a
hit that covers position ``S`` or later loses scores. Hence the cap

    cached prefix H <= min(S, N - 1)            (then rounded down to a block)

    |<------ context P ------>|<--- response R --->|
    [0 ............. H)[H .. S][S ............. N)
     reused from cache  computed   computed and scored

Errors: ``ValueError`` naming ``context`` (P < 1), ``responses`` (an empty response,
N <= P, or no responses), or ``block_size`` (<= 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ScoringCap:
    """The cap of one scoring request, in tokens.

    ``context_len`` P, ``input_len`` N (context + response), ``start`` S = P - 1 (first
    scored position), ``cap_tokens`` = min(S, N - 1) (most tokens a cache hit may cover,
    before rounding down to a block).
    """

    context_len: int
    input_len: int
    start: int
    cap_tokens: int

    def __post_init__(self) -> None:
        assert self.start == self.context_len - 1, f"bug: start {self.start} != P - 1"
        assert self.cap_tokens == min(self.start, self.input_len - 1), "bug: cap != min(S, N-1)"


def cap_tokens(score_start: int, input_len: int) -> int:
    """The most tokens a prefix-cache hit may cover: ``min(S, N - 1)`` (before block rounding).

    The one home of the cap formula: the router (``scoring_cap``) and the replica plugin
    (``replicas.vllm_plugin.contract.resolve_cap``) both call it."""
    return min(score_start, input_len - 1)


def scoring_cap(context_len: int, input_len: int) -> ScoringCap:
    """The cap for context length P = ``context_len`` and input length N = ``input_len``."""
    if context_len < 1:
        raise ValueError(
            f"context must hold at least 1 token (context_len >= 1), got {context_len}"
        )
    if input_len <= context_len:
        raise ValueError(
            f"responses must be non-empty: input_len {input_len} must exceed "
            f"context_len {context_len}"
        )
    start = context_len - 1
    return ScoringCap(context_len, input_len, start, cap_tokens(start, input_len))


def cached_tokens_bound(cap_tokens: int, block_size: int) -> int:
    """Most tokens the cache can serve under ``cap_tokens``: rounded down to a block.

    Example (seed 000): S = 2047, 16-token blocks -> 2032; 32-token blocks -> 2016.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be a positive number of tokens, got {block_size}")
    if cap_tokens < 0:
        raise ValueError(f"cap_tokens must be >= 0, got {cap_tokens}")
    return cap_tokens // block_size * block_size


def _check_group(context_len: int, response_lens: Sequence[int]) -> None:
    if context_len < 1:
        raise ValueError(
            f"context must hold at least 1 token (context_len >= 1), got {context_len}"
        )
    if not response_lens:
        raise ValueError("responses must be a non-empty list of response lengths")
    if min(response_lens) < 1:
        raise ValueError(
            f"responses must be non-empty (each length >= 1), got {list(response_lens)}"
        )


def speedup_bound(context_len: int, response_lens: Sequence[int]) -> float:
    """Upper bound on prefill speedup from reusing a shared context of P tokens.

    Counting prefilled tokens (ignoring that attention grows with position): without reuse
    every request computes P + R_k; with perfect reuse the context is computed once:

        bound = sum_k (P + R_k) / (P + sum_k R_k)

    which is ``K (P + R) / (P + K R)`` for K equal responses of R tokens
    (seed 000: P=3500, R=30, K=4 -> 3.90; P=175, R=730, K=4 -> 1.17).
    """
    _check_group(context_len, response_lens)
    uncached = sum(context_len + r for r in response_lens)
    return uncached / (context_len + sum(response_lens))


def ideal_computed_tokens(context_len: int, response_lens: Sequence[int], block_size: int) -> int:
    """Tokens computed when K scoring requests sharing a context run in sequence, from an
    empty cache, with bounded reuse.

    Request 0 has no hit and computes P + R_0. Request k >= 1 finds the context cached
    (request 0 cached its full blocks) but may reuse only the capped, block-rounded hit
    H_k = floor(min(P - 1, N_k - 1) / B) * B with N_k = P + R_k, so it computes
    (P + R_k) - H_k. Since R_k >= 1, H_k = floor((P - 1) / B) * B for every k:

        total = sum_k (P + R_k) - (K - 1) * floor((P - 1) / B) * B
    """
    _check_group(context_len, response_lens)
    if block_size <= 0:
        raise ValueError(f"block_size must be a positive number of tokens, got {block_size}")
    total = context_len + response_lens[0]
    for r in response_lens[1:]:
        cap = scoring_cap(context_len, context_len + r).cap_tokens
        total += context_len + r - cached_tokens_bound(cap, block_size)
    return total


@dataclass(frozen=True)
class PrefillCost:
    """FLOPs to prefill one prompt row of a dense decoder at position ``p`` (0-based):
    ``linear_flops + attention_flops_per_key * (p + 1)``.

    The token-count bound (:func:`speedup_bound`) treats every row alike; this model adds that a
    row attends to all keys before it, which is what makes late rows (the ones reuse cannot
    skip) dearer than early ones in attention-heavy models.
    """

    linear_flops: float
    """Per row: every layer's Q/K/V/O projections and MLP, plus the LM head (prompt logprobs
    need logits on every computed row)."""
    attention_flops_per_key: float
    """Per row and attended key, all layers: ``QK^T`` and ``PV``."""

    @classmethod
    def llama(cls, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
              vocab: int, head_dim: int | None = None) -> "PrefillCost":
        """From a Llama ``config.json``'s sizes (2 FLOPs per multiply-add); ``head_dim``
        defaults to ``hidden // heads``, as in Hugging Face's ``LlamaConfig``."""
        head_dim = head_dim or hidden // heads
        projections = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim  # Q, O and K, V
        per_layer = 2 * (projections + 3 * hidden * intermediate)  # gate, up, down
        return cls(linear_flops=layers * per_layer + 2 * hidden * vocab,
                   attention_flops_per_key=layers * 4 * heads * head_dim)

    def rows(self, start: int, end: int) -> float:
        """FLOPs for rows at positions ``start .. end - 1``."""
        if not 0 <= start <= end:
            raise ValueError(f"need 0 <= start <= end, got start={start}, end={end}")
        keys = (end * (end + 1) - start * (start + 1)) // 2  # sum of (p + 1) over the rows
        return (end - start) * self.linear_flops + keys * self.attention_flops_per_key


TOKEN_COST = PrefillCost(linear_flops=1.0, attention_flops_per_key=0.0)
"""Every row costs 1: :func:`reuse_costs` then counts tokens (the :func:`speedup_bound` model)."""


def reuse_costs(context_len: int, response_lens: Sequence[int], cost: PrefillCost) -> tuple[float, float]:
    """``(uncached, reused)`` cost of one group: uncached, request k computes rows
    ``0 .. P + R_k - 1``; with perfect reuse, request 0 does too and every other request computes
    only its response rows ``P .. P + R_k - 1``. With :data:`TOKEN_COST` these are
    ``sum_k (P + R_k)`` and ``P + sum_k R_k``."""
    _check_group(context_len, response_lens)
    uncached = sum(cost.rows(0, context_len + r) for r in response_lens)
    reused = cost.rows(0, context_len + response_lens[0]) + sum(
        cost.rows(context_len, context_len + r) for r in response_lens[1:])
    return uncached, reused


def flop_weighted_bound(context_len: int, response_lens: Sequence[int], cost: PrefillCost) -> float:
    """:func:`speedup_bound` with rows weighted by :class:`PrefillCost` (:func:`reuse_costs`).
    Equals the token bound when ``attention_flops_per_key`` is 0."""
    uncached, reused = reuse_costs(context_len, response_lens, cost)
    return uncached / reused
