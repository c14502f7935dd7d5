"""Background loop scraping each replica's /metrics and telling the decision core (health + load).

Owned by the app's cleanup context; cancelled at shutdown; an interval of 0 disables it.
"""

from __future__ import annotations

import asyncio
import logging
import math

import aiohttp

from cache_policy.core import DecisionCore, ReplicaLoad
from cache_policy.types import ReplicaId
from router.metrics import RouterMetrics
from router.pool import ReplicaPool, ReplicaState
from replicas.metrics import parse_vllm_metrics

log = logging.getLogger(__name__)


SCRAPE_TIMEOUT_S = 10.0
FAILURES_OUT_OF_ROTATION = 3
"""A busy replica on a loaded host can miss one scrape; a refused connection counts at once."""


async def scrape_once(http: aiohttp.ClientSession, state: ReplicaState, core: DecisionCore,
                      metrics: RouterMetrics, started_at: float) -> None:
    """Fetch one replica's metrics into ``state`` and the core. A refused connection, or
    ``FAILURES_OUT_OF_ROTATION`` failed scrapes in a row, mark it unhealthy until it answers again;
    so does an engine the core finds stalled (``DecisionCore.stalled``: holding requests, finishing
    no token), until it no longer is (counted in ``rollout_router_replica_stalls_total``). A
    server that answers as a new process (another ``process_start_time_seconds``, a scrape or
    request refused since its last answered scrape, or token counters that went back) stays
    unhealthy, ``state.restarted`` set, for the scrape loop to take as restarted
    (``router.fleet.server_restarted``)."""
    rid = state.endpoint.replica_id
    timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)
    healthy = core.replicas[rid].healthy if rid in core.replicas else True
    try:
        async with http.get(state.endpoint.base_url + "/metrics", timeout=timeout) as r:
            r.raise_for_status()
            text = await r.text()
        m = await asyncio.to_thread(parse_vllm_metrics, text)  # ~15 ms of parsing: off the event loop
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:  # ValueError: not Prometheus text
        state.scrape_failures += 1
        state.silent = isinstance(exc, asyncio.TimeoutError)
        refused = isinstance(exc, aiohttp.ClientConnectorError)
        state.gone = state.gone or (refused and isinstance(exc.os_error, ConnectionRefusedError))  # type: ignore[union-attr]
        if healthy and (refused or state.scrape_failures >= FAILURES_OUT_OF_ROTATION):
            log.warning("replica %s failed %d metrics scrape(s): unhealthy, no request is sent there until a scrape "
                        "answers: %r", rid, state.scrape_failures, exc)
            core.set_health(rid, False)
            state.went_silent = state.went_silent or state.silent
    else:
        state.metrics = m
        state.scrape_failures = 0
        rec = core.replicas.get(rid)
        before, state.process_start_s = state.process_start_s, m.process_start_s or state.process_start_s
        another_process = before > 0 and m.process_start_s > 0 and m.process_start_s != before
        if rec is not None and (another_process or state.gone
                                or m.prompt_tokens + m.generation_tokens < rec.load.finished_tokens):
            # a new process behind the URL (another start time; nothing listened a while ago;
            # vLLM's counters start at 0): its cache is empty and it serves its start-up weights,
            # whatever this router recorded; routed to as it was, its answers would name the
            # fleet's version. Out until the scrape loop takes the restart
            state.gone, state.restarted = False, True
            core.set_health(rid, False)
            metrics.healthy.labels(rid).set(0)
            return
        stalls_before = rec.stalls if rec is not None else 0
        core.observe_load(rid, load_of(m), started_at)
        if rec is not None and rec.stalls > stalls_before:  # every stall, also those in a row while out
            metrics.stalls.labels(rid).inc()
        state.silent = core.stalled(rid, started_at)
        if state.silent and healthy:
            state.went_silent = True
            log.warning("replica %s: its engine holds work (%d request(s) by its metrics, %d of this router's in "
                        "flight%s) but finished no token for %g s or more (stalled): unhealthy, its requests run "
                        "elsewhere", rid, m.num_running + m.num_waiting, core.admission.ledger.count(rid),
                        ", and the router's probe" if rec is not None and rec.probing else "", core.cfg.stall_timeout_s)
        core.set_health(rid, not state.silent)
        if metrics.live(rid):  # (one that left while its scrape was under way has no gauges)
            metrics.kv_usage.labels(rid).set(m.kv_cache_usage)
    metrics.healthy.labels(rid).set(1 if rid in core.replicas and core.replicas[rid].healthy else 0)


def load_of(m) -> ReplicaLoad:
    """The decision core's view of one scrape (``replicas.metrics.VllmMetrics``)."""
    return ReplicaLoad(m.kv_cache_usage, m.num_running, m.num_waiting, m.num_gpu_blocks, m.num_preemptions,
                       m.prompt_tokens + m.generation_tokens)


PROBE_BODY = {"prompt": [0], "max_tokens": 1, "temperature": 0}
"""A probe (``DecisionCore.probe_due``): one token of any vocabulary (ID 0), one generated, no
full block (nothing for the prefix cache to keep)."""


async def probe_engine(http: aiohttp.ClientSession, state: ReplicaState, metrics: RouterMetrics,
                       timeout_s: float, seen: set[str]) -> str:
    """Send one probe to ``state``'s replica and wait for its answer (at most ``timeout_s``):
    ``"ok"`` (HTTP 200), ``"refused"`` (another status), ``"failed"`` (no answer: the connection
    failed) or ``"timeout"``; counted in ``rollout_router_replica_probes_total``, as is one
    cancelled (``"cancelled"``: its replica is being restarted or removed, :meth:`EngineProbes.cancel`,
    or the router stops). An outcome other than ok is logged once per replica and outcome
    (``seen``); a hung engine never answers, and the stall rule, to which the probe is held work,
    says so. Never raises but CancelledError."""
    endpoint = state.endpoint
    try:
        async with http.post(endpoint.base_url + "/v1/completions", json={"model": endpoint.model, **PROBE_BODY},
                             timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            text = await r.text(errors="replace")
            outcome, why = ("ok", "") if r.status == 200 else ("refused", f"HTTP {r.status}: {text[:200]}")
    except asyncio.CancelledError:
        if metrics.live(endpoint.replica_id):  # a removed replica's series are gone: not brought back
            metrics.probes.labels(endpoint.replica_id, "cancelled").inc()
        raise
    except asyncio.TimeoutError:
        outcome, why = "timeout", f"no answer within {timeout_s:g} s"
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        outcome, why = "failed", repr(exc)
    metrics.probes.labels(endpoint.replica_id, outcome).inc()  # a counter: counted even mid-restart (as stalls)
    if outcome != "ok" and f"{endpoint.replica_id}:{outcome}" not in seen:
        seen.add(f"{endpoint.replica_id}:{outcome}")
        log.warning("replica %s: the probe of its idle engine (a one-token completion) got %s (logged once per "
                    "replica and outcome): %s", endpoint.replica_id, outcome, why)
    return outcome


def idle_budget(replicas: int, interval_s: float, period_s: float) -> int:
    """How many idle replicas one scrape round probes at most: enough that each of ``replicas``
    is probed once per ``period_s`` (``policy.stall_probe_after_s``) with rounds every
    ``interval_s`` seconds, and at least one."""
    if period_s <= 0 or interval_s <= 0:
        return max(1, replicas)
    return max(1, math.ceil(replicas * interval_s / period_s))


class EngineProbes:
    """Probes in flight, at most one per replica (``DecisionCore.probe_due``): each is work the
    engine holds for the stall rule until it ends (``probe_sent`` / ``probe_ended``)."""

    def __init__(self) -> None:
        self._pending: dict[ReplicaId, asyncio.Task] = {}
        self._seen: set[str] = set()

    def start_due(self, http: aiohttp.ClientSession, pool: ReplicaPool, core: DecisionCore, metrics: RouterMetrics,
                  now: float, timeout_s: float, interval_s: float = 0.0) -> list[ReplicaId]:
        """Probe the replicas due at ``now`` with none in flight; the replicas probed.

        Idle replicas are probed at most :func:`idle_budget` per call, the longest idle first
        (a replica at its stall's end, ``ReplicaRecord.suspect``, at once): replicas that went idle
        together (the end of a rollout step) are probed a scrape round apart, and stay apart, as
        every probe starts its replica's next period. A fresh attacker saw every idle engine of
        one 2-core host probed in the same round (each probe took ~7 s there, and a 5 s
        ``policy.stall_timeout_s`` stalled a healthy engine on its own probe); a later new user
        saw a per-replica stretch of the period drift two replicas back into one round."""
        due = []
        for state in list(pool.states()):
            rid = state.endpoint.replica_id
            if rid not in self._pending and core.probe_due(rid, now):
                rec = core.replicas[rid]
                due.append((not rec.suspect, rec.checked_at or 0.0, rid, state))
        due.sort(key=lambda d: d[:2])
        budget = idle_budget(len(core.replicas), interval_s, core.cfg.stall_probe_after_s)
        started = []
        for idle, _, rid, state in due:
            if idle:
                if budget <= 0:
                    break
                budget -= 1
            core.probe_sent(rid, now)
            task = asyncio.create_task(probe_engine(http, state, metrics, timeout_s, self._seen))
            self._pending[rid] = task
            task.add_done_callback(lambda task, rid=rid: self._ended(core, rid, task))
            started.append(rid)
        return started

    def _ended(self, core: DecisionCore, rid: ReplicaId, task: asyncio.Task) -> None:
        if self._pending.get(rid) is not task:  # cancelled by :meth:`cancel`, which ended it
            return
        del self._pending[rid]
        outcome = None if task.cancelled() or task.exception() is not None else task.result()
        core.probe_ended(rid, {"ok": True, "timeout": False}.get(outcome))

    def cancel(self, core: DecisionCore, rid: ReplicaId) -> bool:
        """Cancel the probe in flight on ``rid``, if any, and end it now as one that told nothing
        (``DecisionCore.probe_ended(rid, None)``): its server is being restarted or removed, so
        what it answers, or when, says nothing of the engine that comes back (a fresh attacker saw
        ``probing: true`` listed ~17 s into a restart, for a probe sent to the hung engine before
        it). Whether one was in flight."""
        task = self._pending.pop(rid, None)
        if task is None:
            return False
        task.cancel()
        core.probe_ended(rid, None)
        return True

    async def close(self) -> None:
        """Cancel the probes in flight (the router is stopping)."""
        tasks = list(self._pending.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class ScrapeRounds:
    """The scrape loop's rounds: at most one scrape per replica in flight, and a round waits for
    them at most ``wait_s``. A replica that hangs (until ``SCRAPE_TIMEOUT_S``) holds up neither the
    round nor the other replicas' scrapes; its scrape finishes (or fails) in a later round."""

    def __init__(self) -> None:
        self._pending: dict[ReplicaId, asyncio.Task] = {}

    async def run(self, http: aiohttp.ClientSession, pool: ReplicaPool, core: DecisionCore,
                  metrics: RouterMetrics, started_at: float, wait_s: float) -> list[BaseException]:
        """Start a scrape of every replica with none in flight, wait up to ``wait_s`` seconds;
        return the exceptions of the scrapes that ended (``scrape_once`` raised: a bug, logged by the caller)."""
        for state in list(pool.states()):
            rid = state.endpoint.replica_id
            if rid not in self._pending:
                self._pending[rid] = asyncio.create_task(scrape_once(http, state, core, metrics, started_at))
        if self._pending:
            await asyncio.wait(list(self._pending.values()), timeout=wait_s)
        errors: list[BaseException] = []
        for rid, task in list(self._pending.items()):
            if task.done():
                del self._pending[rid]
                if not task.cancelled() and task.exception() is not None:
                    errors.append(task.exception())
        return errors

    async def close(self) -> None:
        """Cancel the scrapes still in flight (the router is stopping)."""
        tasks, self._pending = list(self._pending.values()), {}
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
