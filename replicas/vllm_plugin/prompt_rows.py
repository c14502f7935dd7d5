"""Front end: rows before S come back as ``None``; rows from S on keep their absolute entries.

Patches ``LogprobsProcessor.from_new_request`` and ``._update_prompt_logprobs``
(``vllm/v1/engine/logprobs.py``). For a request carrying a valid S, the processor remembers S
and N; when the prompt-logprob rows arrive it appends ``None`` for entries ``1 .. S`` and
detokenizes only rows ``S ..`` (entries ``S+1 .. N-1``), so the list keeps N entries and the
detokenizer never sees a row that was not computed. The engine core normally sends rows
``S ..`` only (:mod:`.score_check`); a full N - 1-row buffer (e.g. from an engine that fell
back) is cut the same way, so callers always get the same shape.

A request carrying ``vllm_xargs.rollout_router_detokenize: false`` (with or without S) gets its
prompt-logprob rows without decoded tokens: the processor's tokenizer is dropped, as vLLM does
for ``SamplingParams.detokenize=False``. Requests with neither take vLLM's path unchanged.
"""

from __future__ import annotations

from typing import Any, Callable

from replicas.vllm_plugin.contract import ScoreStartError, score_start_of, skips_detokenize, validate_score_start
from replicas.vllm_plugin.patching import wrap

SCORE_START_ATTR = "_rollout_router_score_start"
NUM_ROWS_ATTR = "_rollout_router_num_rows"


def install() -> None:
    from vllm.v1.engine.logprobs import LogprobsProcessor

    wrap(LogprobsProcessor, "from_new_request", _make_from_new_request)
    wrap(LogprobsProcessor, "_update_prompt_logprobs", _make_update)


def _make_from_new_request(original: Callable) -> Callable:
    def from_new_request(cls, tokenizer, request):
        params = request.sampling_params
        if params is not None and params.prompt_logprobs is not None and skips_detokenize(params.extra_args):
            tokenizer = None  # rows keep ids, logprobs and ranks; decoded_token is None
        processor = original(cls, tokenizer, request)
        score_start = _valid_score_start(request)
        if score_start is not None and processor.prompt_logprobs is not None:
            setattr(processor, SCORE_START_ATTR, score_start)
            setattr(processor, NUM_ROWS_ATTR, len(request.prompt_token_ids) - 1)
        return processor

    return from_new_request


def _make_update(original: Callable) -> Callable:
    def _update_prompt_logprobs(self, prompt_logprobs_tensors):
        score_start = getattr(self, SCORE_START_ATTR, None)
        if score_start is None:
            return original(self, prompt_logprobs_tensors)
        num_rows = getattr(self, NUM_ROWS_ATTR)
        received = len(self.prompt_logprobs) - 1  # entry 0 is vLLM's leading None
        drop, pad = rows_to_drop_and_pad(
            num_rows, score_start, received, prompt_logprobs_tensors.logprobs.shape[0]
        )
        for _ in range(pad):
            self.prompt_logprobs.append(None)
        if drop:
            prompt_logprobs_tensors = _drop_rows(prompt_logprobs_tensors, drop)
        return original(self, prompt_logprobs_tensors)

    return _update_prompt_logprobs


def rows_to_drop_and_pad(num_rows: int, score_start: int, received: int, incoming: int) -> tuple[int, int]:
    """How many leading incoming rows to drop, and how many ``None`` entries to append first.

    ``num_rows`` = N - 1; ``received`` rows are already in the list (after entry 0);
    ``incoming`` rows arrive now. Both runners deliver a request's rows once, at the end of
    its prefill, as the trailing rows of the buffer (all N - 1, rows from the cache hit, or
    rows from S), so the first piece is aligned from the end: it starts at row
    ``num_rows - incoming``. Rows before S are dropped and replaced by ``None``; were a piece to
    start after S (the engine core fails such requests first), the gap is ``None`` as well.
    A later piece, should one come, continues the list as vLLM would.
    """
    if received:
        return 0, 0
    first_row = num_rows - incoming
    pad = max(score_start, first_row)
    return pad - first_row, pad


def _drop_rows(tensors: Any, drop: int) -> Any:
    return tensors._replace(
        logprob_token_ids=tensors.logprob_token_ids[drop:],
        logprobs=tensors.logprobs[drop:],
        selected_token_ranks=tensors.selected_token_ranks[drop:],
    )


def _valid_score_start(request: Any) -> int | None:
    params = request.sampling_params
    value = score_start_of(params.extra_args) if params is not None else None
    if value is None or request.prompt_token_ids is None:
        return None
    try:
        return validate_score_start(value, len(request.prompt_token_ids))
    except ScoreStartError:
        return None  # validation already answered 400; never raise in the output path
