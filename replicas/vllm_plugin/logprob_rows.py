"""Prompt-logprob rows by absolute position: the sentinel, the completeness check, trimming.

The model runners hold a request's prompt logprobs as a ``LogprobsTensors`` (a NamedTuple of
``logprob_token_ids [rows, k+1]``, ``logprobs [rows, k+1]``, ``selected_token_ranks [rows]``;
``vllm/v1/outputs.py``) whose row ``i`` is the model output at position ``i``. Rows a runner
never computes (those under a cache hit) are filled with a sentinel instead of uninitialised
memory, so they can be told apart from real rows:

* rank ``-1`` (real ranks are >= 1),
* logprob ``NaN``,
* token id ``0`` (a valid id, so nothing that detokenizes it can crash).

Pure torch functions over anything shaped like ``LogprobsTensors`` (they use ``_replace``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

SENTINEL_RANK = -1
SENTINEL_TOKEN_ID = 0
SENTINEL_LOGPROB = float("nan")


class MissingRows(NamedTuple):
    """Rows from S on that hold the sentinel: how many, and the first one (absolute row)."""

    count: int
    first: int


def fill_sentinel(tensors: Any) -> Any:
    """Overwrite every row of ``tensors`` with the sentinel, in place; return it."""
    tensors.logprob_token_ids.fill_(SENTINEL_TOKEN_ID)
    tensors.logprobs.fill_(SENTINEL_LOGPROB)
    tensors.selected_token_ranks.fill_(SENTINEL_RANK)
    return tensors


def missing_rows(tensors: Any, score_start: int) -> MissingRows:
    """Sentinel rows at or after row ``score_start`` (a full buffer: row i = position i)."""
    ranks = tensors.selected_token_ranks[score_start:]
    bad = (ranks < 1).nonzero()
    if bad.numel() == 0:
        return MissingRows(0, -1)
    return MissingRows(int(bad.numel()), score_start + int(bad[0, 0]))


def trim_rows(tensors: Any, score_start: int) -> Any:
    """Rows ``score_start ..`` only, as contiguous copies (what the front end needs)."""
    return tensors._replace(
        logprob_token_ids=tensors.logprob_token_ids[score_start:].contiguous(),
        logprobs=tensors.logprobs[score_start:].contiguous(),
        selected_token_ranks=tensors.selected_token_ranks[score_start:].contiguous(),
    )


def prepend_sentinel_rows(tensors: Any, num_rows: int) -> Any:
    """``num_rows`` sentinel rows, then ``tensors``: turns rows that start at a cache hit into a
    buffer indexed by absolute position (for the V2 runner, which emits rows from the hit)."""
    if num_rows <= 0:
        return tensors
    ids, lps, ranks = tensors.logprob_token_ids, tensors.logprobs, tensors.selected_token_ranks
    return tensors._replace(
        logprob_token_ids=torch.cat([ids.new_full((num_rows, ids.shape[1]), SENTINEL_TOKEN_ID), ids]),
        logprobs=torch.cat([lps.new_full((num_rows, lps.shape[1]), SENTINEL_LOGPROB), lps]),
        selected_token_ranks=torch.cat([ranks.new_full((num_rows,), SENTINEL_RANK), ranks]),
    )
