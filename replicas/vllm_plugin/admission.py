"""Engine core, admission: resolve the cap once and store it on the engine's ``Request``.

Patches ``EngineCore.preprocess_add_request`` (``vllm/v1/engine/core.py``), which builds every
``Request`` via ``Request.from_engine_core_request`` (``vllm/v1/request.py``) for both the
in-process and the multiprocess engine. For a scoring request carrying a valid S on an engine
that supports the cap, the wrapper sets on the new ``Request``:

* ``rollout_router_score_start`` = S (read by the score check in :mod:`.score_check`),
* ``rollout_router_cache_cap`` = ``min(S, N - 1)``, further capped at ``prompt_logprob_start``
  for ``prompt_logprob_token_ids`` requests (read by :mod:`.cache_lookup`),
* ``skip_reading_prefix_cache`` = False, which ``SamplingParams.__post_init__`` had set to True
  for every prompt-logprob request.

The caller's ``SamplingParams`` are left as they are, and ``Request.get_skip_reading_prefix_cache``
is not patched (KV connectors call it). S was validated by the front end
(:mod:`.validation`); a malformed S that reaches the engine some other way is ignored here
(cache reads stay off), never raised, so it cannot fail other requests.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from replicas.vllm_plugin.contract import (
    REQUEST_CACHE_CAP_ATTR,
    REQUEST_SCORE_START_ATTR,
    ScoreStartError,
    resolve_cap,
    score_start_of,
    validate_score_start,
)
from replicas.vllm_plugin.patching import wrap
from replicas.vllm_plugin.support import engine_support
from replicas.vllm_plugin.testing_hooks import skip_cap_requested

logger = logging.getLogger("vllm.rollout_router.scoring_cap")


def install() -> None:
    from vllm.v1.engine.core import EngineCore

    wrap(EngineCore, "preprocess_add_request", _make_wrapper)


def _make_wrapper(original: Callable) -> Callable:
    def preprocess_add_request(self, request):
        req, wave = original(self, request)
        if score_start_of(_extra_args(req)) is not None:
            admit_scoring_request(req, engine_support(self).active)
        return req, wave

    return preprocess_add_request


def admit_scoring_request(req: Any, engine_supported: bool) -> None:
    """Store S and the cap on ``req`` and turn its cache reads on, when everything allows it."""
    params = req.sampling_params
    if not engine_supported or not _is_scoring(params) or not _text_only(req):
        return
    try:
        score_start = validate_score_start(score_start_of(params.extra_args), req.num_prompt_tokens)
    except ScoreStartError as e:
        logger.warning("request %s: %s; scoring it with cache reads off", req.request_id, e)
        return
    setattr(req, REQUEST_SCORE_START_ATTR, score_start)
    if not skip_cap_requested(params.extra_args):
        setattr(req, REQUEST_CACHE_CAP_ATTR, _cap(params, score_start, req.num_tokens))
    req.skip_reading_prefix_cache = False


def _cap(params: Any, score_start: int, num_tokens: int) -> int:
    cap = resolve_cap(score_start, num_tokens)
    if params.prompt_logprob_token_ids is not None:
        cap = min(cap, params.prompt_logprob_start or 0)
    return cap


def _is_scoring(params: Any) -> bool:
    return params is not None and (
        params.prompt_logprobs is not None or params.prompt_logprob_token_ids is not None
    )


def _text_only(req: Any) -> bool:
    return req.prompt_embeds is None and not req.mm_features and req.prompt_token_ids is not None


def _extra_args(req: Any) -> Any:
    params = req.sampling_params
    return None if params is None else params.extra_args
