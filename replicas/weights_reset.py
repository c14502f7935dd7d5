"""A prefix-cache reset that is confirmed, never assumed.

vLLM empties the prefix cache only when no request holds a KV block
(``KVCacheManager.reset_prefix_cache`` -> ``BlockPool.reset_prefix_cache``); otherwise it leaves
the cache as it is. vLLM 0.32 says which happened in the answer to ``POST /reset_prefix_cache``
(``{"success": bool}``). Older servers answered 200 with no verdict and reported a refusal only in
their log; for them the reset is confirmed with a probe (see :func:`confirm_by_probe`).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Awaitable, Callable

import aiohttp

from replicas.weights_http import Answer, call, is_paused

PROBE_TOKEN = 100
"""Token id the probe prompt repeats; any vocabulary of a real model has it."""
PROBE_LEN = 257
"""Probe prompt length: at least one full block for block sizes up to 256."""


@dataclass(frozen=True)
class ResetOutcome:
    """The result of :func:`reset_prefix_cache_outcome`."""

    confirmed: bool
    """True only when the server (or the probe) showed that the prefix cache was emptied."""
    detail: str
    """Why: what the server answered, and how many times it was asked."""
    attempts: int
    """``POST /reset_prefix_cache`` calls made."""


async def reset_prefix_cache_outcome(
    http: aiohttp.ClientSession,
    base_url: str,
    *,
    timeout_s: float = 5.0,
    retry_interval_s: float = 0.25,
    preempt_running: bool = False,
) -> ResetOutcome:
    """``POST /reset_prefix_cache`` until vLLM confirms it, or ``timeout_s`` passes.

    ``preempt_running=True`` sends ``reset_running_requests=true``: vLLM first preempts every
    running request (they re-prefill later), so the reset cannot be refused by them.
    A 4xx answer (e.g. 404 without ``VLLM_SERVER_DEV_MODE=1``) ends the attempts at once.
    """
    url = f"{base_url}/reset_prefix_cache"
    params = {"reset_running_requests": "true"} if preempt_running else None
    deadline = time.monotonic() + timeout_s
    attempts = 0
    while True:
        attempts += 1
        answer = await call(http, "POST", url, params=params, timeout_s=timeout_s)
        verdict = _verdict(answer)
        if verdict is True:
            return ResetOutcome(True, "vLLM answered success=true", attempts)
        if verdict is None and answer.ok:
            reset = lambda: call(http, "POST", url, params=params, timeout_s=timeout_s)  # noqa: E731
            return await confirm_by_probe(http, base_url, reset, timeout_s=timeout_s, attempts=attempts)
        if 400 <= answer.status < 500 or time.monotonic() + retry_interval_s > deadline:
            return ResetOutcome(False, _refusal(answer, attempts, timeout_s), attempts)
        await asyncio.sleep(retry_interval_s)


async def reset_prefix_cache_confirmed(
    http: aiohttp.ClientSession,
    base_url: str,
    *,
    timeout_s: float = 5.0,
    retry_interval_s: float = 0.25,
    preempt_running: bool = False,
) -> bool:
    """True iff the prefix cache was really emptied (see :func:`reset_prefix_cache_outcome`)."""
    outcome = await reset_prefix_cache_outcome(
        http, base_url, timeout_s=timeout_s, retry_interval_s=retry_interval_s,
        preempt_running=preempt_running,
    )
    return outcome.confirmed


async def confirm_by_probe(
    http: aiohttp.ClientSession,
    base_url: str,
    reset: Callable[[], Awaitable[Answer]],
    *,
    timeout_s: float = 5.0,
    attempts: int = 0,
) -> ResetOutcome:
    """Confirm a reset by watching a probe prompt's cache hit disappear.

    Sends a probe prompt (under its own ``cache_salt``, so no other traffic can hit it or be hit
    by it) twice and checks the second one hits (a third time when the first got no answer, which
    cached nothing); calls ``reset``; sends it again and confirms
    only if that finds 0 cached tokens. Needs an unpaused engine (a paused one would queue the
    probe) and ``--enable-prompt-tokens-details``; without either it returns not confirmed.
    """
    if await is_paused(http, base_url, timeout_s):
        return ResetOutcome(False, "no verdict from /reset_prefix_cache, and a paused engine "
                                   "cannot be probed", attempts)
    probe = _Probe(http, base_url, timeout_s)
    before = [await probe.cached_tokens(), await probe.cached_tokens()]
    if before[0] is None and before[1] == 0:  # the first probe failed (a busy engine) and primed nothing
        before.append(await probe.cached_tokens())
    if before[-1] is None or before[-1] <= 0:
        why = f"; {probe.last_error}" if probe.last_error else ""
        return ResetOutcome(False, f"no verdict from /reset_prefix_cache, and the probe prompt "
                                   f"could not be made to hit the cache (cached tokens {before}{why})", attempts)
    answer = await reset()
    after = await probe.cached_tokens()
    if answer.ok and after == 0:
        return ResetOutcome(True, "probe: the cached probe prompt missed after the reset", attempts + 1)
    return ResetOutcome(False, f"probe: the probe prompt still hit {after} cached tokens after the "
                               f"reset ({answer.describe()})", attempts + 1)


class _Probe:
    """One probe prompt with a salt of its own; ``cached_tokens()`` sends it once."""

    def __init__(self, http: aiohttp.ClientSession, base_url: str, timeout_s: float) -> None:
        self._http, self._base_url, self._timeout_s = http, base_url, timeout_s
        self._salt = f"rollout-router-reset-probe-{uuid.uuid4().hex}"
        self._model: str | None = None
        self.last_error: str | None = None
        """Why the last probe request gave no count (the answer, described), if it did not."""

    async def cached_tokens(self) -> int | None:
        """Cached prompt tokens of one probe request; None if the server does not say."""
        body = {"model": await self._model_id(), "prompt": [PROBE_TOKEN] * PROBE_LEN,
                "max_tokens": 1, "cache_salt": self._salt}
        answer = await call(self._http, "POST", f"{self._base_url}/v1/completions", body=body,
                            timeout_s=self._timeout_s)
        if not answer.ok or not isinstance(answer.body, dict):
            self.last_error = f"probe request: {answer.describe()}"
            return None
        details = (answer.body.get("usage") or {}).get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens")
        self.last_error = None if cached is not None else "the answer has no usage.prompt_tokens_details.cached_tokens"
        return int(cached) if cached is not None else None

    async def _model_id(self) -> str | None:
        if self._model is None:
            answer = await call(self._http, "GET", f"{self._base_url}/v1/models", timeout_s=self._timeout_s)
            data = answer.body.get("data") if answer.ok and isinstance(answer.body, dict) else None
            self._model = data[0]["id"] if data else None
        return self._model


def _verdict(answer: Answer) -> bool | None:
    """``success`` from a 200 answer; None when the answer carries no verdict."""
    if answer.ok and isinstance(answer.body, dict) and isinstance(answer.body.get("success"), bool):
        return answer.body["success"]
    return None


def _refusal(answer: Answer, attempts: int, timeout_s: float) -> str:
    if answer.ok:
        return (f"vLLM refused the prefix-cache reset {attempts} time(s) in {timeout_s} s "
                "(success=false: running requests still hold KV blocks)")
    return f"POST /reset_prefix_cache failed after {attempts} attempt(s): {answer.describe()}"
