"""Per-engine check: does this engine's configuration support the bounded cache hit?

The first version is narrow on purpose: text inputs, one full-attention KV cache group,
unquantized KV, no speculative decoding, no KV connector or offloading, no context parallelism.
Anything else falls back to vLLM's own behaviour (scoring requests skip cache reads), which is
always exact. :func:`check_engine_support` reads only plain config attributes, so tests can pass
fake objects; :func:`engine_support` caches the answer on a live ``EngineCore``.

Touches nothing in vLLM: reads ``VllmConfig`` (``vllm/config/vllm.py``) and the engine's
``KVCacheConfig`` (``vllm/v1/kv_cache_interface.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("vllm.rollout_router.scoring_cap")

ENGINE_SUPPORT_ATTR = "_rollout_router_scoring_cap_support"
FULL_ATTENTION_SPECS = ("FullAttentionSpec", "MLAAttentionSpec")
"""KV cache spec classes (by name) that keep every position of the prefix."""


@dataclass(frozen=True)
class Support:
    """Whether the cap is active on an engine, and why not when it is not."""

    active: bool
    reason: str
    """``"ok"`` when active; otherwise what made the engine fall back, e.g.
    ``"quantized KV cache (kv_cache_dtype=fp8)"``."""


ACTIVE = Support(True, "ok")


def check_engine_support(vllm_config: Any, kv_cache_config: Any, v2_runner_patched: bool) -> Support:
    """The first unsupported feature of an engine, or :data:`ACTIVE`.

    ``v2_runner_patched`` says whether this process could patch the V2 model runner's prompt
    logprobs (``vllm/v1/worker/gpu/sample/prompt_logprob.py``); without it a V2 engine falls back.
    """
    for check in (_check_cache, _check_features, _check_parallel):
        reason = check(vllm_config)
        if reason:
            return Support(False, reason)
    if vllm_config.use_v2_model_runner and not v2_runner_patched:
        return Support(False, "V2 model runner without the plugin's V2 patch")
    reason = _check_kv_groups(kv_cache_config)
    return Support(False, reason) if reason else ACTIVE


def _check_cache(cfg: Any) -> str:
    cache = cfg.cache_config
    if not cache.enable_prefix_caching:
        return "prefix caching disabled"
    if cache.cache_dtype != "auto":
        return f"quantized KV cache (kv_cache_dtype={cache.cache_dtype})"
    if cache.kv_offloading_size is not None:
        return "KV cache offloading"
    if cache.kv_sharing_fast_prefill:
        return "kv_sharing_fast_prefill (prompt logprobs are incorrect with it)"
    return ""


def _check_features(cfg: Any) -> str:
    if cfg.speculative_config is not None:
        return "speculative decoding"
    if cfg.kv_transfer_config is not None:
        return "KV connector"
    if cfg.ec_transfer_config is not None:
        return "encoder cache connector"
    model = cfg.model_config
    if model.enable_prompt_embeds:
        return "prompt embeds enabled"
    if model.is_multimodal_model:
        return "multimodal model"
    if model.get_sliding_window() is not None:
        return "sliding window attention"
    return ""


def _check_parallel(cfg: Any) -> str:
    par = cfg.parallel_config
    if par.decode_context_parallel_size > 1 or par.prefill_context_parallel_size > 1:
        return "context parallelism"
    return ""


def _check_kv_groups(kv_cache_config: Any) -> str:
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        return f"{len(groups)} KV cache groups"
    spec = groups[0].kv_cache_spec
    kind = type(spec).__name__
    if kind not in FULL_ATTENTION_SPECS:
        return f"KV cache spec {kind} is not full attention"
    if getattr(spec, "sliding_window", None) is not None:
        return "sliding window attention"
    if getattr(spec, "attention_chunk_size", None) is not None:
        return "chunked local attention"
    return ""


def engine_support(engine_core: Any) -> Support:
    """:func:`check_engine_support` for a live ``EngineCore``, computed once and cached on it."""
    cached = getattr(engine_core, ENGINE_SUPPORT_ATTR, None)
    if cached is None:
        from vllm.v1.core.sched.scheduler import Scheduler

        from replicas.vllm_plugin import runner_v2

        scheduler = engine_core.scheduler
        if not isinstance(scheduler, Scheduler):
            cached = Support(False, f"scheduler class {type(scheduler).__name__} is not vLLM's")
        else:
            cached = check_engine_support(
                engine_core.vllm_config, scheduler.kv_cache_config, runner_v2.installed()
            )
        setattr(engine_core, ENGINE_SUPPORT_ATTR, cached)
        if cached.active:
            logger.info("rollout_router scoring cap active on this engine")
        else:
            logger.warning("rollout_router scoring cap inactive on this engine (scoring requests "
                           "skip cache reads): %s", cached.reason)
    return cached
