"""Worker side, V2 model runner (GPU only, needs Triton): prompt-logprob rows by absolute position.

Patches ``PromptLogprobsWorker.compute_prompt_logprobs`` and ``.remove_request``
(``vllm/v1/worker/gpu/sample/prompt_logprob.py``). The V2 runner concatenates a request's
prompt-logprob chunks starting at its first computed position (the cache hit H) with no offset,
so a request that hit the cache would come back with its rows shifted. The wrapper records H
when the request's first prefill chunk runs and prepends H sentinel rows to what vLLM emits,
which yields the same N - 1-row buffer, indexed by absolute position, as the V1 runner.
Preemption on V2 removes and re-adds the request, so ``remove_request`` forgets H and the
resumed prefill records its new hit.

The ``prompt_logprob_token_ids`` path (``compute_prompt_token_id_logprobs``) already places rows
relative to ``prompt_logprob_start`` and drops a request whose prefill starts past it; the
admission hook caps the hit at ``prompt_logprob_start`` too, so that path needs no patch here.

Only a GPU with Triton runs this module's wrappers; the row arithmetic is unit-tested on CPU.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from replicas.vllm_plugin.logprob_rows import prepend_sentinel_rows
from replicas.vllm_plugin.patching import is_wrapped, wrap

FIRST_ROWS_ATTR = "_rollout_router_first_rows"


def install() -> None:
    from vllm.v1.worker.gpu.sample.prompt_logprob import PromptLogprobsWorker

    wrap(PromptLogprobsWorker, "compute_prompt_logprobs", _make_compute_wrapper)
    wrap(PromptLogprobsWorker, "remove_request", _make_remove_wrapper)


def installed() -> bool:
    """Whether this process runs the V2 prompt-logprob patch."""
    import sys

    module = sys.modules.get("vllm.v1.worker.gpu.sample.prompt_logprob")
    return module is not None and is_wrapped(module.PromptLogprobsWorker, "compute_prompt_logprobs")


def first_rows(worker: Any) -> dict[str, int]:
    """req_id -> position of the request's first computed prompt row (its cache hit)."""
    rows = getattr(worker, FIRST_ROWS_ATTR, None)
    if rows is None:
        rows = {}
        setattr(worker, FIRST_ROWS_ATTR, rows)
    return rows


def record_first_rows(
    rows: dict[str, int],
    req_ids: list[str],
    uses_prompt_logprobs: np.ndarray,
    computed_prefill: np.ndarray,
    prompt_lens: np.ndarray,
    prefill_lens: np.ndarray,
) -> None:
    """Remember where each prompt-logprob request's prefill starts, on its first chunk only.

    Arrays are per batch row. Mirrors vLLM's own mask: a row counts while its prompt is being
    prefilled and it was not resumed after its prompt was done.
    """
    needs = uses_prompt_logprobs & (computed_prefill < prompt_lens) & ~(prompt_lens < prefill_lens)
    for i in np.flatnonzero(needs):
        rows.setdefault(req_ids[i], int(computed_prefill[i]))


def _make_compute_wrapper(original: Callable) -> Callable:
    def compute_prompt_logprobs(
        self, logits_fn, hidden_states, input_batch, all_token_ids, num_computed_tokens, prompt_lens
    ):
        rows = first_rows(self)
        idx = input_batch.idx_mapping_np
        record_first_rows(
            rows,
            input_batch.req_ids,
            self.uses_prompt_logprobs[idx],
            input_batch.num_computed_prefill_tokens_np,
            prompt_lens[idx],
            input_batch.prefill_len_np,
        )
        out = original(
            self, logits_fn, hidden_states, input_batch, all_token_ids, num_computed_tokens, prompt_lens
        )
        for req_id, tensors in out.items():
            out[req_id] = prepend_sentinel_rows(tensors, rows.pop(req_id, 0))
        return out

    return compute_prompt_logprobs


def _make_remove_wrapper(original: Callable) -> Callable:
    def remove_request(self, req_id):
        first_rows(self).pop(req_id, None)
        return original(self, req_id)

    return remove_request
