"""Front end: reject a malformed S with HTTP 400 naming the field, before the engine sees it.

Patches ``InputProcessor.process_inputs`` (``vllm/v1/engine/input_processor.py``), the step
that turns every prompt (HTTP or ``LLM``) into an ``EngineCoreRequest`` and knows its token
count N. After vLLM's own processing, a request carrying S must be a scoring request
(``prompt_logprobs`` or ``prompt_logprob_token_ids`` set) and S must satisfy
:func:`~replicas.vllm_plugin.contract.validate_score_start`. Otherwise the wrapper raises
``VLLMValidationError(parameter="vllm_xargs.rollout_router_score_start")``, which the OpenAI
server answers with HTTP 400 (``vllm/entrypoints/serve/exception_handling/error_response.py``).
The engine core itself never raises on S.
"""

from __future__ import annotations

from typing import Any, Callable

from replicas.vllm_plugin.contract import (
    SCORE_START_FIELD,
    ScoreStartError,
    score_start_of,
    validate_score_start,
)
from replicas.vllm_plugin.patching import wrap


def install() -> None:
    from vllm.v1.engine.input_processor import InputProcessor

    wrap(InputProcessor, "process_inputs", _make_wrapper)


def _make_wrapper(original: Callable) -> Callable:
    def process_inputs(self, *args, **kwargs):
        request = original(self, *args, **kwargs)
        check_request(request)
        return request

    return process_inputs


def check_request(request: Any) -> None:
    """Raise ``VLLMValidationError`` if the ``EngineCoreRequest`` carries a bad S."""
    params = request.sampling_params
    value = score_start_of(params.extra_args) if params is not None else None
    if value is None:
        return
    from vllm.exceptions import VLLMValidationError

    if params.prompt_logprobs is None and params.prompt_logprob_token_ids is None:
        raise VLLMValidationError(
            f"{SCORE_START_FIELD} is only meaningful for scoring requests: set prompt_logprobs "
            "(0 or more) as well, or drop the field",
            parameter=SCORE_START_FIELD,
            value=value,
        )
    try:
        validate_score_start(value, _num_prompt_tokens(request))
    except ScoreStartError as e:
        raise VLLMValidationError(str(e), parameter=SCORE_START_FIELD, value=value) from e


def _num_prompt_tokens(request: Any) -> int:
    if request.prompt_token_ids is not None:
        return len(request.prompt_token_ids)
    return len(request.prompt_embeds)
