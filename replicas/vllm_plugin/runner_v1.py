"""Worker side, V1 model runner (the only path on CPU): sentinel-filled prompt-logprob buffers.

Patches ``GPUModelRunner._get_prompt_logprobs_dict`` (``vllm/v1/worker/gpu_model_runner.py``;
``CPUModelRunner`` inherits it). vLLM allocates each request's buffer of N - 1 rows with
``LogprobsTensors.empty_cpu`` (uninitialised memory) on the request's first prefill chunk and
writes rows at absolute positions from ``request.num_computed_tokens``, so rows under a cache
hit are never written. The wrapper allocates that buffer itself, just before vLLM would, filled
with the sentinel (:mod:`replicas.vllm_plugin.logprob_rows`); vLLM then finds it in
``in_progress_prompt_logprobs_cpu`` and writes real rows over it. The buffer outlives
preemption there, and rows of resumed chunks land at their absolute positions.

Applies to every prompt-logprob request (rows a request computes are overwritten as before, so
requests without S come back unchanged).
"""

from __future__ import annotations

from typing import Any, Callable

from replicas.vllm_plugin.logprob_rows import fill_sentinel
from replicas.vllm_plugin.patching import wrap


def install() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    wrap(GPUModelRunner, "_get_prompt_logprobs_dict", _make_wrapper)


def _make_wrapper(original: Callable) -> Callable:
    def _get_prompt_logprobs_dict(self, hidden_states, num_scheduled_tokens):
        if self.num_prompt_logprobs:
            _preallocate_sentinel_buffers(self, num_scheduled_tokens)
        return original(self, hidden_states, num_scheduled_tokens)

    return _get_prompt_logprobs_dict


def _preallocate_sentinel_buffers(runner: Any, num_scheduled_tokens: dict[str, int]) -> None:
    from vllm.v1.outputs import LogprobsTensors

    for req_id, num_prompt_logprobs in runner.num_prompt_logprobs.items():
        state = runner.requests.get(req_id)
        if (
            req_id not in num_scheduled_tokens
            or state is None
            or state.prompt_token_ids is None
            or state.in_progress_prompt_logprobs_cpu is not None
        ):
            continue
        buffer = LogprobsTensors.empty_cpu(len(state.prompt_token_ids) - 1, num_prompt_logprobs + 1)
        state.in_progress_prompt_logprobs_cpu = fill_sentinel(buffer)
