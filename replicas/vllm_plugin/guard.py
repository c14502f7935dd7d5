"""Load-time guard: is this exactly the vLLM the plugin was written against?

``register()`` patches nothing unless every check here passes, in every process: the version,
each module and symbol the patches touch, each patched function's parameters, and the few
lines of vLLM source whose behaviour the patches rely on (read with ``inspect.getsource``; no
source, no patch). Any mismatch yields a reason string and vLLM stays untouched, so scoring
requests keep skipping cache reads. The V2 model runner is checked separately
(:data:`V2_TARGETS`): it is only importable where Triton is, and a V2 engine whose patch is
missing falls back per engine (:mod:`.support`).
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, NamedTuple

SUPPORTED_VLLM_VERSIONS = ("0.32.0",)


class Target(NamedTuple):
    """One thing the plugin relies on: ``module:qualname``, its exact parameter names (None: not
    checked; a trailing ``"..."``: only this prefix) and source fragments that must appear in it."""

    module: str
    qualname: str
    params: tuple[str, ...] | None = None
    source: tuple[str, ...] = ()


TARGETS: tuple[Target, ...] = (
    Target("vllm.v1.engine.core", "EngineCore.preprocess_add_request", ("self", "request"),
           ("Request.from_engine_core_request(",)),
    Target("vllm.v1.request", "Request.__init__", None,
           ("self.skip_reading_prefix_cache = self.get_skip_reading_prefix_cache()",)),
    Target("vllm.v1.core.kv_cache_manager", "KVCacheManager.get_computed_blocks", ("self", "request"),
           ("max_cache_hit_length = request.num_tokens - 1", "self.coordinator.find_longest_cache_hit(")),
    Target("vllm.v1.core.kv_cache_coordinator", "UnitaryKVCacheCoordinator.find_longest_cache_hit",
           ("self", "block_hashes", "max_cache_hit_length")),
    Target("vllm.v1.core.sched.scheduler", "Scheduler._get_local_prefix_cache_hit", ("self", "request"),
           ("self.kv_cache_manager.get_computed_blocks(request)",)),
    Target("vllm.v1.core.sched.scheduler", "Scheduler.update_from_output",
           ("self", "scheduler_output", "model_runner_output"),
           ("prompt_logprobs_dict.get(req_id)", "new_prompt_logprobs_tensors=prompt_logprobs_tensors")),
    Target("vllm.v1.core.sched.scheduler", "Scheduler.finish_requests",
           ("self", "request_ids", "finished_status")),
    Target("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._get_prompt_logprobs_dict",
           ("self", "hidden_states", "num_scheduled_tokens"),
           ("request.in_progress_prompt_logprobs_cpu", "LogprobsTensors.empty_cpu(",
            "start_idx = request.num_computed_tokens")),
    Target("vllm.v1.outputs", "LogprobsTensors.empty_cpu", ("num_positions", "num_tokens_per_position")),
    Target("vllm.v1.engine.logprobs", "LogprobsProcessor.from_new_request", ("tokenizer", "request")),
    Target("vllm.v1.engine.logprobs", "LogprobsProcessor._update_prompt_logprobs",
           ("self", "prompt_logprobs_tensors"),
           ("token_ids, logprobs, ranks, *_ = prompt_logprobs_tensors",)),
    Target("vllm.v1.engine.input_processor", "InputProcessor.process_inputs",
           ("self", "request_id", "prompt", "params", "...")),
    Target("vllm.entrypoints.launchers.api_server.entry", "init_app_state",
           ("engine_client", "state", "args", "supported_tasks")),
    Target("vllm.entrypoints.launchers.api_server.entry", "build_and_serve", None,
           ("await init_app_state(engine_client, app.state, args, supported_tasks)",)),
    Target("vllm.v1.engine.core_client", "AsyncMPClient.call_utility_async", ("self", "method", "...")),
    Target("vllm.config.model", "ModelConfig.get_sliding_window", ("self",)),
    Target("vllm.config.model", "ModelConfig.is_multimodal_model"),
    Target("vllm.config.vllm", "VllmConfig.use_v2_model_runner"),
    Target("vllm.v1.engine", "FinishReason.ERROR"),
    Target("vllm.v1.request", "RequestStatus.FINISHED_ERROR"),
    Target("vllm.exceptions", "VLLMValidationError"),
)
"""Everything the required patches touch (V1 runner, engine core, front end)."""

V2_TARGETS: tuple[Target, ...] = (
    Target("vllm.v1.worker.gpu.sample.prompt_logprob", "PromptLogprobsWorker.compute_prompt_logprobs",
           ("self", "logits_fn", "hidden_states", "input_batch", "all_token_ids",
            "num_computed_tokens", "prompt_lens"),
           ("computed_prefill = input_batch.num_computed_prefill_tokens_np",
            "resumed_after_prompt = prompt_lens < input_batch.prefill_len_np",
            "logprobs = LogprobsTensors.cat(prompt_logprobs_list)")),
    Target("vllm.v1.worker.gpu.sample.prompt_logprob", "PromptLogprobsWorker.remove_request",
           ("self", "req_id")),
)

FIELDS: dict[str, tuple[str, ...]] = {
    "vllm.v1.engine:EngineCoreOutput": ("request_id", "new_token_ids", "finish_reason", "new_logprobs",
                                         "new_prompt_logprobs_tensors", "prompt_token_id_logprobs"),
    "vllm.v1.outputs:ModelRunnerOutput": ("prompt_logprobs_dict", "prompt_token_id_logprobs_dict"),
    "vllm.v1.outputs:LogprobsTensors": ("logprob_token_ids", "logprobs", "selected_token_ranks"),
    "vllm.v1.core.sched.output:SchedulerOutput": ("scheduled_new_reqs",),
    "vllm.config.cache:CacheConfig": ("enable_prefix_caching", "cache_dtype", "kv_offloading_size",
                                      "kv_sharing_fast_prefill"),
    "vllm.config.vllm:VllmConfig": ("speculative_config", "kv_transfer_config", "ec_transfer_config"),
    "vllm.config.model:ModelConfig": ("enable_prompt_embeds",),
    "vllm.config.parallel:ParallelConfig": ("decode_context_parallel_size", "prefill_context_parallel_size"),
}
"""Dataclass / NamedTuple / msgspec fields read or written by the patches."""


def check_version(version: str) -> str:
    """'' if ``version`` (``vllm.__version__``, local part ignored) is supported, else why not."""
    base = version.split("+", 1)[0]
    if base in SUPPORTED_VLLM_VERSIONS:
        return ""
    return f"vLLM {version} is not a version this plugin was checked against {SUPPORTED_VLLM_VERSIONS}"


def check_targets(targets: tuple[Target, ...]) -> str:
    """'' if every target exists with its parameters and source fragments, else the first miss."""
    for target in targets:
        reason = _check_target(target)
        if reason:
            return reason
    return ""


def check_fields(fields: dict[str, tuple[str, ...]]) -> str:
    """'' if every named class declares the listed fields, else the first missing one."""
    for where, names in fields.items():
        module, _, cls_name = where.partition(":")
        try:
            cls = getattr(importlib.import_module(module), cls_name)
        except (ImportError, AttributeError) as e:
            return f"{where}: {e}"
        declared = _declared_fields(cls)
        missing = [n for n in names if n not in declared]
        if missing:
            return f"{where} lacks field(s) {missing}"
    return ""


def check_all(version: str) -> str:
    """The first reason not to patch this process's vLLM, or ''."""
    return check_version(version) or check_targets(TARGETS) or check_fields(FIELDS)


def _check_target(target: Target) -> str:
    where = f"{target.module}:{target.qualname}"
    try:
        obj: Any = importlib.import_module(target.module)
        for part in target.qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        return f"{where} not found ({e})"
    if target.params is not None:
        params = tuple(inspect.signature(obj).parameters)
        want = target.params
        if want[-1:] == ("...",):
            want, params = want[:-1], params[: len(want) - 1]
        if params != want:
            return f"{where} has parameters {params}, expected {target.params}"
    return _check_source(where, obj, target.source)


def _check_source(where: str, obj: Any, fragments: tuple[str, ...]) -> str:
    if not fragments:
        return ""
    try:
        source = inspect.getsource(obj)
    except (OSError, TypeError) as e:
        return f"{where}: source unavailable ({e})"
    missing = [f for f in fragments if f not in source]
    return f"{where} no longer contains {missing}" if missing else ""


def _declared_fields(cls: Any) -> set[str]:
    names = set(getattr(cls, "__dataclass_fields__", {}))
    names |= set(getattr(cls, "_fields", ()))  # NamedTuple
    names |= set(getattr(cls, "__struct_fields__", ()))  # msgspec.Struct
    names |= set(getattr(cls, "model_fields", {}))  # pydantic
    return names
