"""The scoring-request contract: the key that carries S, what S means, and the cap it implies.

Pure Python (no vLLM import), shared by the front-end validation, the engine-core admission
hook and the tests.

Positions and rows
------------------
A scoring request sends N input tokens ``t[0..N-1]``: a context ``t[0..P-1]`` followed by a
response ``t[P..N-1]`` (R = N - P tokens), and asks for ``prompt_logprobs``.

* vLLM's ``prompt_logprobs`` list has N entries. Entry 0 is always ``None``; entry ``j``
  (``1 <= j <= N-1``) is ``log p(t[j] | t[<j])``, read off the model output at position ``j-1``.
  The model runner keeps these in a buffer of N - 1 *rows*: row ``i`` = entry ``i + 1`` =
  the output at position ``i``.
* ``S = P - 1`` is the first scored position: row S (entry ``S + 1 = P``) scores the first
  response token. The scored rows are ``S .. N-2`` (``N - 1 - S = R`` of them).
* A valid S is an integer with ``0 <= S <= N - 2`` (at least one scored row).
* With the plugin loaded in the API server, entries ``0 .. S`` come back as ``None`` and
  entries ``S+1 .. N-1`` carry the scores, so ``prompt_logprobs[P:]`` are the response scores.

Errors (HTTP, ``/v1/completions``)
----------------------------------
* Malformed S (not an integer, negative, > N - 2) or S without ``prompt_logprobs``: 400,
  ``error.param == "vllm_xargs.rollout_router_score_start"``, the message says what is wrong.
  (vLLM's request model turns a JSON ``true`` into ``1`` before the plugin sees it.)
* A row from S on missing when the request finishes (a bug, or a cache path the plugin does
  not cap): the request alone fails with ``finish_reason`` error, which the server answers with
  500 ``{"error": {"message": "Internal server error", "type": "InternalServerError"}}``;
  the engine core logs the missing rows. Retrying without S is always safe.

The cap
-------
The prefix-cache hit may cover at most ``min(S, N - 1)`` tokens, i.e. positions ``[0, S)``:
position S and everything after it are computed, so every scored row has its logits. The cache
works in whole blocks, so the hit is further rounded down: ``(cap // block_size) * block_size``
(S = 2047 with 32-token blocks gives a 2016-token hit).
"""

from __future__ import annotations

from typing import Any, Mapping

from cache_policy.scoring import cached_tokens_bound, cap_tokens

SCORE_START_KEY = "rollout_router_score_start"
"""``SamplingParams.extra_args`` key (``vllm_xargs`` over HTTP) carrying S, the first scored
position (``P - 1``)."""

INVARIANT_ATTENTION_ENV = "ROLLOUT_ROUTER_INVARIANT_ATTENTION"
"""Replica environment variable; ``"1"`` turns on chunk-invariant CPU attention
(:mod:`replicas.vllm_plugin.invariant_attention`), which makes capped rows bit-identical."""

DETOKENIZE_KEY = "rollout_router_detokenize"
"""``vllm_xargs`` key: ``false`` (with ``prompt_logprobs`` set) makes the plugin's front end skip
detokenizing the request's logprob entries, prompt rows and any sampled-token logprobs alike
(``decoded_token`` comes back ``null``; the generated text is unaffected). Scoring callers read logprobs by
token id; detokenizing ~1,000 rows per response was most of the API server's time. Any request
may carry it, with or without S; a replica without the plugin ignores it."""


def skips_detokenize(extra_args: Mapping[str, Any] | None) -> bool:
    """Whether a request asked for prompt-logprob rows without decoded tokens."""
    return bool(extra_args) and extra_args.get(DETOKENIZE_KEY) in (False, 0, "false")


SCORE_START_FIELD = f"vllm_xargs.{SCORE_START_KEY}"
"""How validation errors name the field (the HTTP body path of the key)."""

REQUEST_SCORE_START_ATTR = "rollout_router_score_start"
"""Attribute the engine core sets on its ``Request``: S, resolved once at admission."""

REQUEST_CACHE_CAP_ATTR = "rollout_router_cache_cap"
"""Attribute the engine core sets on its ``Request``: the most tokens a cache hit may cover."""


class ScoreStartError(ValueError):
    """A caller's S is malformed or out of range; the message names the field and the fix."""


def score_start_of(extra_args: Mapping[str, Any] | None) -> Any:
    """The raw S value a request carries, or ``None`` when it carries none."""
    if not extra_args:
        return None
    return extra_args.get(SCORE_START_KEY)


def validate_score_start(value: Any, num_prompt_tokens: int) -> int:
    """Return S as an int, or raise :class:`ScoreStartError` naming the field.

    ``num_prompt_tokens`` is N. S must be a JSON integer (not a bool, float or string)
    with ``0 <= S <= N - 2``.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise ScoreStartError(
            f"{SCORE_START_FIELD} must be an integer (the first scored position, "
            f"context length - 1), got {value!r}"
        )
    if value < 0:
        raise ScoreStartError(f"{SCORE_START_FIELD} must be >= 0, got {value}")
    if value > num_prompt_tokens - 2:
        raise ScoreStartError(
            f"{SCORE_START_FIELD}={value} leaves no scored row in a {num_prompt_tokens}-token "
            f"input: it must be <= N - 2 = {num_prompt_tokens - 2} (S = P - 1, and the "
            f"response needs at least one token)"
        )
    return value


def resolve_cap(score_start: int, num_tokens: int) -> int:
    """The most tokens a prefix-cache hit may cover: ``min(S, N - 1)`` (``cache_policy.scoring``)."""
    return cap_tokens(score_start, num_tokens)


def block_rounded_hit(cap: int, block_size: int) -> int:
    """The largest cache hit the cap allows once rounded down to whole blocks (``cache_policy.scoring``)."""
    return cached_tokens_bound(cap, block_size)
