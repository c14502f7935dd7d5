"""rollout-router's vLLM plugin: reuse the prefix cache for scoring requests, bounded at S.

Entry point ``vllm.general_plugins: rollout_router_scoring_cap = replicas.vllm_plugin:register``
(``pyproject.toml``). A scoring request (``prompt_logprobs`` >= 0) that carries S, the first
scored position (``P - 1``), in ``SamplingParams.extra_args[SCORE_START_KEY]`` (HTTP:
``"vllm_xargs": {"rollout_router_score_start": S}``) reads the prefix cache up to
``min(S, N - 1)`` tokens (rounded down to a block) instead of not at all; rows before S come
back as ``None``, rows from S on are exact or the request fails. See :mod:`.contract` for the
positions, :mod:`.guard` for what is checked before patching and :mod:`.support` for the
configurations that fall back. Modules, one concern each:

=========================  ===============================================================
``guard``                  version / symbol / signature / source checks (all-or-nothing)
``support``                per-engine configuration check
``admission``              engine core: S and the cap onto the ``Request`` (EngineCore)
``cache_lookup``           engine core: cap every cache lookup (KVCacheManager)
``score_check``            engine core: completeness check, trim, per-request error (Scheduler)
``runner_v1``              worker: sentinel-filled prompt-logprob buffer (GPUModelRunner)
``runner_v2``              worker, GPU: absolute rows for the V2 runner (PromptLogprobsWorker)
``validation``             front end: HTTP 400 for a bad S (InputProcessor)
``prompt_rows``            front end: ``None`` before S (LogprobsProcessor)
``metrics``                ``rollout_router_scoring_cap_active`` gauge on /metrics
``invariant_attention``    worker, CPU, opt-in: attention rows independent of chunking
=========================  ===============================================================
"""

from __future__ import annotations

import logging

from replicas.vllm_plugin.contract import SCORE_START_KEY

__all__ = ["SCORE_START_KEY", "register", "registration_result"]

logger = logging.getLogger("vllm.rollout_router.scoring_cap")
_result: str | None = None
"""None: register() has not run in this process; "": patched; else why it refused."""


def register() -> None:
    """Install the patches once per process, or refuse and leave vLLM untouched. Never raises
    (vLLM calls general plugins unguarded; an exception would stop the process)."""
    global _result
    if _result is not None:
        return
    try:
        _result = _install()
    except Exception as e:  # a bug in the plugin must not take the replica down
        _result = f"plugin error: {e!r}"
        logger.exception("rollout_router scoring cap: install failed, vLLM left as it was")
    if _result:
        _report_refusal(_result)


def registration_result() -> str | None:
    """None before :func:`register` ran here, "" once patched, else the refusal reason."""
    return _result


def _install() -> str:
    import vllm

    from replicas.vllm_plugin import guard, patching

    reason = guard.check_all(vllm.__version__)
    if reason:
        return reason
    mark = patching.checkpoint()
    try:
        for install in _installers():
            install()
    except Exception:
        patching.restore_since(mark)  # all or nothing
        raise
    logger.info("rollout_router scoring cap: patches installed (vLLM %s)", vllm.__version__)
    return ""


def _installers() -> list:
    from replicas.vllm_plugin import (
        admission, cache_lookup, guard, invariant_attention, metrics, prompt_rows, runner_v1, runner_v2,
        score_check, validation,
    )

    installers = [admission.install, cache_lookup.install, score_check.install, runner_v1.install,
                  validation.install, prompt_rows.install, metrics.install_engine_status,
                  metrics.install_frontend_probe]
    v2_reason = guard.check_targets(guard.V2_TARGETS)
    if v2_reason:  # no Triton here, or a V2 runner this plugin does not know: V2 engines fall back
        logger.info("rollout_router scoring cap: V2 model runner not patched (%s)", v2_reason)
    else:
        installers.append(runner_v2.install)
    if invariant_attention.enabled():
        reason = guard.check_targets(invariant_attention.TARGETS)
        if reason:  # exactness degrades to ~1e-6 differences; the cap itself still works
            logger.warning("rollout_router: chunk-invariant attention not installed (%s)", reason)
        else:
            installers.append(invariant_attention.install)
    return installers


def _report_refusal(reason: str) -> None:
    logger.warning("rollout_router scoring cap disabled, scoring requests skip cache reads: %s", reason)
    try:
        from replicas.vllm_plugin import metrics

        metrics.set_gauge(False, f"plugin refused: {reason}")
    except Exception:  # the gauge is a report; failing to export it must not stop vLLM
        logger.exception("rollout_router scoring cap: could not export the gauge")
