"""Fault run: steady mixed RL load on real vLLM replicas, one replica killed mid-run, against the
same run without the fault.

    flock /tmp/vllm.lock .venv/bin/python -m bench.fault                # SIGKILL an API server
    flock /tmp/vllm.lock .venv/bin/python -m bench.fault --kill engine  # SIGKILL an engine core

Two small supervised replicas (``--gpu-blocks`` KV blocks each) behind a router that follows their
events. Each run starts from empty prefix caches and a fresh router and sends the same fixed work
(``bench.fault_load.MixedWorkload`` with ``limit``: sessions, GRPO groups and ``/v1/score``
fan-outs, greedy); the fault run SIGKILLs replica-0's API server (or engine core) ``--kill-at-s``
seconds in, as soon as a session's turn is running there, and the supervisor restarts it at a new URL while the load goes on. The table
(``bench.fault_report``) compares the two runs, counters from the replicas' own ``/metrics``;
scoring rows of the fault run are compared with the run without it, bit for bit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

import aiohttp

from bench.fault_load import MixedLoad, MixedWorkload
from bench.fault_report import RunSummary, Window, render, summarize
from replicas.config import ReplicaSetConfig
from replicas.metrics import VllmMetrics
from replicas.ops import fetch_metrics, reset_prefix_cache
from replicas.procs import group_members
from replicas.replica_set import ReplicaSet
from replicas.supervisor import SupervisionConfig
from router.cli import add_dataclass_flags, dataclass_overrides
from router import keys
from router.config import AppConfig
from router.server import running_router

VICTIM = "replica-0"
BACK_WITHIN_S = 300.0
DEFAULT_WORK = dict(sessions=3, session_turns=6, reply_tokens=48, groups=1, group_size=4, scorers=1,
                    think_s=0.3, group_think_s=1.0, score_think_s=1.0, limit=36, group_limit=100, score_limit=95)
"""About 2 minutes of each kind on two tiny-model replicas on 2 cores, less with one down (on 2 cores
one replica alone runs faster than each of two); the killed replica (a restart under this load takes
70-110 s here) should return before the fault run ends, else a probe measures when it serves again."""


async def _counters(rs: ReplicaSet, rids: list[str]) -> dict[str, VllmMetrics]:
    async with aiohttp.ClientSession(middlewares=(rs.auth,), timeout=aiohttp.ClientTimeout(total=30)) as http:
        values = await asyncio.gather(*(fetch_metrics(http, rs.endpoint(r).base_url) for r in rids))
    return dict(zip(rids, values))


async def _reset_caches(rs: ReplicaSet) -> None:
    async with aiohttp.ClientSession(middlewares=(rs.auth,), timeout=aiohttp.ClientTimeout(total=60)) as http:
        for ep in rs.endpoints:
            if not await reset_prefix_cache(http, ep.base_url):
                raise RuntimeError(f"{ep.replica_id} refused to reset its prefix cache; results would be skewed")


async def _killer(rs: ReplicaSet, what: str):
    """A function that SIGKILLs the victim's API server (its group dies with it) or its engine core."""
    pgid = (await rs.info(VICTIM)).pid
    if what == "api":
        return lambda: os.kill(pgid, signal.SIGKILL)
    core = [p for p in group_members(pgid) if b"EngineCore" in Path(f"/proc/{p}/cmdline").read_bytes()]
    if len(core) != 1:
        raise RuntimeError(f"expected one EngineCore process in {VICTIM}'s group {pgid}, found {core}")
    return lambda: os.kill(core[0], signal.SIGKILL)


async def run_once(cfg: AppConfig, rs: ReplicaSet, w: MixedWorkload, kill: str | None, kill_at_s: float,
                   reference: dict) -> tuple[RunSummary, dict]:
    """One run of ``w`` through a fresh router; with ``kill``, SIGKILL the victim ``kill_at_s`` in."""
    await _reset_caches(rs)
    rids = [e.replica_id for e in rs.endpoints]
    before = await _counters(rs, rids)
    restarted: list[float] = []
    unsubscribe = rs.subscribe(lambda e: restarted.append(time.monotonic())
                               if e.kind == "restarted" and e.replica_id == VICTIM else None)
    windows, killed_at, probe_at = [], None, None
    started = time.monotonic()
    async with running_router(cfg, rs.endpoints, replica_set=rs) as (url, app):
        async with aiohttp.ClientSession() as http:
            load = MixedLoad(http, url, w, tag="fault" if kill else "clean", reference=reference)
            load.start()
            if kill:
                await asyncio.sleep(kill_at_s)
                killer = await _killer(rs, kill)
                await _session_turn_on_victim(load, app[keys.CORE])
                at_kill = await _counters(rs, [VICTIM])
                killer()
                killed_at = time.monotonic()
                windows.append(Window(VICTIM, before[VICTIM], at_kill[VICTIM], decodes_checked=False))
            records = await load.wait()
            wall = time.monotonic() - started
            deadline = time.monotonic() + BACK_WITHIN_S
            while kill and not restarted and time.monotonic() < deadline:
                await asyncio.sleep(0.5)
            await asyncio.sleep(1.0)  # the engines publish their last counters
            after = await _counters(rs, [e.replica_id for e in rs.endpoints])
            if kill and restarted and not load.served_by(VICTIM, after=restarted[0]):
                probe_at = await _probe(http, url)  # the load ended first: when does it serve a request?
    unsubscribe()
    for rid in rids:
        if rid == VICTIM and kill:
            if restarted:  # its new incarnation's counters start at 0 at its restart
                windows.append(Window(VICTIM, VllmMetrics(), after[VICTIM], served_since=restarted[0]))
        else:
            windows.append(Window(rid, before[rid], after[rid]))
    summary = summarize("fault" if kill else "no fault", records, windows, wall, VICTIM if kill else None,
                        killed_at, restarted[0] if restarted else None)
    if probe_at is not None and killed_at is not None:
        summary.kill_to_served_s = round(probe_at - killed_at, 1)
        summary.served_by_probe = True
    return summary, {"records": [asdict(r) for r in records], "killed_at": killed_at,
                     "restarted_at": restarted[0] if restarted else None, "probe_served_at": probe_at}


async def _session_turn_on_victim(load: MixedLoad, core, timeout_s: float = 30.0) -> None:
    """Wait (at most ``timeout_s``) until a session pinned to the victim has a turn admitted there:
    the kill then catches one, as it would under any steady load."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if core.in_flight(VICTIM) and any(load.last_replica.get(k) == VICTIM for k in load.in_flight):
            return
        await asyncio.sleep(0.01)


async def _probe(http: aiohttp.ClientSession, url: str) -> float | None:
    """Send fresh one-token requests, four at a time (the least loaded replica gets a fresh prompt),
    until one is served by the victim; when it was (or None)."""

    async def one(seed: int) -> bool:
        body = {"prompt": [9 + (seed * 7 + j * 13) % 900 for j in range(40)], "max_tokens": 1}
        async with http.post(url + "/v1/completions", json=body) as r:
            return r.status == 200 and r.headers.get("X-Rollout-Replica") == VICTIM

    for i in range(20):
        if any(await asyncio.gather(*(one(4 * i + k) for k in range(4)))):
            return time.monotonic()
        await asyncio.sleep(0.25)
    return None


async def main_async(args: argparse.Namespace) -> list[RunSummary]:
    w = MixedWorkload(**{**DEFAULT_WORK, **dataclass_overrides(args, MixedWorkload)})
    replicas = ReplicaSetConfig(num_replicas=2, max_model_len=4096,
                                extra_args=("--num-gpu-blocks-override", str(args.gpu_blocks)))
    cfg = AppConfig().replace(router={"port": 0, "scrape_interval_s": 0.5})
    supervision = SupervisionConfig(interval_s=1.0, health_timeout_s=5.0, backoff_initial_s=0.5)
    print(f"starting 2 vLLM replicas ({args.gpu_blocks} KV blocks each) ...", flush=True)
    async with ReplicaSet(replicas, supervision=supervision) as rs:
        reference: dict = {}
        clean, clean_raw = await run_once(cfg, rs, w, None, args.kill_at_s, reference)
        print(f"run without the fault: {clean.wall_s} s", flush=True)
        fault, fault_raw = await run_once(cfg, rs, w, args.kill, args.kill_at_s, reference)
    command = "python -m bench.fault " + " ".join(sys.argv[1:] if args.argv is None else args.argv)
    print(render([clean, fault], command.strip()))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({
            "command": command, "workload": asdict(w), "kill": args.kill, "kill_at_s": args.kill_at_s,
            "summaries": [asdict(clean), asdict(fault)], "runs": {"no_fault": clean_raw, "fault": fault_raw}},
            indent=1))
        print(f"wrote {args.out}")
    return [clean, fault]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.fault", description=__doc__.splitlines()[0],
                                     epilog=f"Workload flags not given take these values: {DEFAULT_WORK}")
    add_dataclass_flags(parser, MixedWorkload)
    parser.add_argument("--kill", choices=("api", "engine"), default="api",
                        help="SIGKILL the victim's API server (its whole process group dies) or its engine core")
    parser.add_argument("--kill-at-s", type=float, default=10.0, help="seconds into the fault run")
    parser.add_argument("--gpu-blocks", type=int, default=512, help="KV cache blocks (32 tokens) per replica")
    parser.add_argument("--out", default="results/fault.json")
    args = parser.parse_args(argv)
    args.argv = argv
    asyncio.run(main_async(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
