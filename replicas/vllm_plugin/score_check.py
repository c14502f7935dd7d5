"""Engine core, outputs: reject an incomplete score buffer as that request's own error.

Patches ``Scheduler.update_from_output`` (``vllm/v1/core/sched/scheduler.py``), which turns the
worker's ``ModelRunnerOutput.prompt_logprobs_dict`` into ``EngineCoreOutput``s. For every
request admitted with S (:mod:`.admission`):

* before vLLM builds the outputs, its prompt-logprob buffer (row i = position i, sentinel rows
  where nothing was computed; :mod:`.runner_v1`, :mod:`.runner_v2`) is checked from row S on.
  Complete: the buffer is trimmed to rows ``S ..`` (the front end pads the rows before S with
  ``None``; :mod:`.prompt_rows`). Incomplete: the buffer is dropped and the request is failed.
* after vLLM builds them, a request that finished with a success status but never delivered
  its scores (prompt logprobs or ``prompt_token_id_logprobs``) is failed as well.

Failing a request finishes it with ``RequestStatus.FINISHED_ERROR`` if it is still running and
rewrites its output of this step to ``finish_reason=FinishReason.ERROR`` with no tokens and no
logprobs, which the OpenAI server answers with HTTP 500. Nothing here raises: an exception in a
scheduler step would kill the EngineCore and every request in it.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from replicas.vllm_plugin.contract import REQUEST_SCORE_START_ATTR
from replicas.vllm_plugin.logprob_rows import missing_rows, trim_rows
from replicas.vllm_plugin.patching import wrap

logger = logging.getLogger("vllm.rollout_router.scoring_cap")

DELIVERED_ATTR = "_rollout_router_scores_delivered"
LIVE_ATTR = "_rollout_router_live_scoring"


def install() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    wrap(Scheduler, "update_from_output", _make_wrapper)


def _make_wrapper(original: Callable) -> Callable:
    def update_from_output(self, scheduler_output, model_runner_output):
        live = _track_new(self, scheduler_output)
        failed = screen_prompt_logprobs(self.requests, model_runner_output)
        outputs = original(self, scheduler_output, model_runner_output)
        if live:
            for req_id, why in _finished_without_scores(live).items():
                failed.setdefault(req_id, why)  # keep the more precise reason
        if failed:
            _fail(self, outputs, failed)
        return outputs

    return update_from_output


def screen_prompt_logprobs(requests: dict[str, Any], model_runner_output: Any) -> dict[str, tuple[Any, str]]:
    """Check and trim the buffers of requests with S; return ``{req_id: (request, why)}`` to fail."""
    _mark_token_id_scores(requests, model_runner_output.prompt_token_id_logprobs_dict)
    buffers = model_runner_output.prompt_logprobs_dict
    failed: dict[str, tuple[Any, str]] = {}
    replaced: dict[str, Any] = {}
    for req_id, tensors in buffers.items():
        req = requests.get(req_id)
        score_start = getattr(req, REQUEST_SCORE_START_ATTR, None)
        if score_start is None or tensors is None:
            continue
        missing = missing_rows(tensors, score_start)
        if missing.count:
            why = (f"{missing.count} prompt-logprob rows from S={score_start} on were never computed "
                   f"(first: row {missing.first})")
            failed[req_id] = (req, why)
            replaced[req_id] = None
        else:
            replaced[req_id] = trim_rows(tensors, score_start)
            setattr(req, DELIVERED_ATTR, True)
    if replaced:
        model_runner_output.prompt_logprobs_dict = {**buffers, **replaced}
    return failed


def _mark_token_id_scores(requests: dict[str, Any], scores: dict[str, Any]) -> None:
    for req_id in scores:
        req = requests.get(req_id)
        if req is not None:
            setattr(req, DELIVERED_ATTR, True)


def _track_new(scheduler: Any, scheduler_output: Any) -> dict[str, Any]:
    """The scheduler's live requests with S, including those first scheduled in this step."""
    live = getattr(scheduler, LIVE_ATTR, None)
    if live is None:
        live = {}
        setattr(scheduler, LIVE_ATTR, live)
    for new in scheduler_output.scheduled_new_reqs:
        req = scheduler.requests.get(new.req_id)
        if getattr(req, REQUEST_SCORE_START_ATTR, None) is not None:
            live[new.req_id] = req
    return live


def _finished_without_scores(live: dict[str, Any]) -> dict[str, tuple[Any, str]]:
    from vllm.v1.request import RequestStatus

    success = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED,
               RequestStatus.FINISHED_REPETITION)
    failed = {}
    for req_id, req in list(live.items()):
        if not req.is_finished():
            continue
        del live[req_id]
        if req.status in success and not getattr(req, DELIVERED_ATTR, False):
            failed[req_id] = (req, "finished without its prompt-logprob rows")
    return failed


def _fail(scheduler: Any, outputs: dict[int, Any], failed: dict[str, tuple[Any, str]]) -> None:
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
    from vllm.v1.request import RequestStatus

    for req_id, (req, why) in failed.items():
        logger.error("rollout_router scoring cap: request %s failed: %s", req_id, why)
        scheduler.finish_requests(req_id, RequestStatus.FINISHED_ERROR)
        out = _find_output(outputs, req_id)
        if out is None:
            out = EngineCoreOutput(request_id=req_id, new_token_ids=[])
            outputs.setdefault(req.client_index, EngineCoreOutputs()).outputs.append(out)
        out.finish_reason = FinishReason.ERROR
        out.new_token_ids = []
        out.new_logprobs = None
        out.new_prompt_logprobs_tensors = None
        out.prompt_token_id_logprobs = None


def _find_output(outputs: dict[int, Any], req_id: str) -> Any:
    for engine_outputs in outputs.values():
        for out in engine_outputs.outputs:
            if out.request_id == req_id:
                return out
    return None
