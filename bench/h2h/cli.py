"""``python -m bench.h2h``: this router vs vllm-router and sglang-router on the same simulated replicas.

One run: start N simulated replicas (``bench.h2h.replicas_main``, the simulator's engine model
behind vLLM's HTTP API) and one zero-cost replica; for every router and workload, reset the
replicas, start the router, drive the workload (``bench.h2h.drive``), read the replicas' counters,
stop the router; then the router-added latency (``bench.h2h.latency``), with py-spy on ours when
``--profile``. Prints the table; JSON (and the py-spy profile) under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from bench.h2h import profile, report
from bench.h2h.drive import run_workload
from bench.h2h.latency import measure
from bench.h2h.routers import ALL, ROOT, RunningRouter
from bench.sim.workloads import WorkloadConfig

WORKLOADS = {"grpo": {"grpo"}, "agent": {"agent"}, "mix": {"grpo", "agent"}}


def workload_config(args: argparse.Namespace) -> WorkloadConfig:
    """RL traffic sized for seconds of wall time per run (sizes from the flags)."""
    return WorkloadConfig(groups_per_replica=args.groups_per_replica, group_size=16, grpo_prompt=(2000, 8000),
                          grpo_output=(32, 128), sessions_per_replica=args.sessions_per_replica, turns=8,
                          first_prompt=(1000, 3000), observation=(200, 800), reply=(32, 128),
                          tool_pause_s=args.tool_pause_s)


def num_blocks(args: argparse.Namespace, cfg: WorkloadConfig) -> int:
    """Blocks per replica: ``--cache-ratio`` of the mix's live working set, at least one 8k prompt + group."""
    ws = cfg.working_set_tokens(args.replicas, WORKLOADS["mix"])
    return max(1024, int(ws * args.cache_ratio / args.replicas / args.block_size))


@asynccontextmanager
async def replica_process(n: int, blocks: int, block_size: int, cost: str, tokenizer: str, log: Path):
    """The replicas' process; yields their URLs; SIGTERM on exit."""
    urls_file = Path(tempfile.mkdtemp(prefix="h2h-")) / "urls.json"
    argv = [sys.executable, "-m", "bench.h2h.replicas_main", "--replicas", str(n), "--num-blocks", str(blocks),
            "--block-size", str(block_size), "--cost", cost, "--tokenizer", tokenizer, "--urls-file", str(urls_file)]
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        for _ in range(240):
            if urls_file.exists() or proc.poll() is not None:
                break
            await asyncio.sleep(0.25)
        if not urls_file.exists():
            raise RuntimeError(f"simulated replicas did not start (log: {log})")
        yield json.loads(urls_file.read_text())
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


async def replica_stats(urls: list[str], reset: bool = False) -> list[dict]:
    """Each replica's engine counters (or reset them all)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        out = []
        for u in urls:
            req = http.post(f"{u}/sim/reset") if reset else http.get(f"{u}/sim/stats")
            async with req as r:
                out.append(await r.json())
        return out


def summarize(run: dict, stats: list[dict]) -> dict:
    """Table row: prefilled / ideal and busiest / mean (requests and prefilled tokens)."""
    pre = sum(s["prefilled_tokens"] for s in stats)
    reqs = [s["requests"] for s in stats]
    pres = [s["prefilled_tokens"] for s in stats]
    mean_r, mean_p = sum(reqs) / len(reqs), sum(pres) / len(pres)
    return {**run, "prefilled_tokens": pre, "prefilled_over_ideal": pre / run["ideal_prefilled_tokens"],
            "busiest_over_mean_requests": max(reqs) / mean_r if mean_r else float("nan"),
            "busiest_over_mean_prefill": max(pres) / mean_p if mean_p else float("nan"),
            "replica_requests": reqs, "replica_prefilled": pres}


async def run_workloads(args: argparse.Namespace, specs: list, workloads: list[str], result: dict,
                        tokenizer: str, logs: Path, on_run: Callable[[str], None], tick: Callable[[], None]) -> None:
    """Every router of ``specs`` on every workload, on ``args.replicas`` simulated replicas; rows
    into ``result["workloads"]``. ``on_run(description)`` before each run, ``tick`` per request."""
    cfg = workload_config(args)
    rust_venv = Path(args.rust_venv).resolve()
    async with replica_process(args.replicas, result["num_blocks"], args.block_size, "fast", tokenizer,
                               logs / "replicas.log") as urls:
        for spec in (s for s in specs if s.workloads):
            for w in workloads:
                on_run(f"{w:5s} {spec.name}")
                await replica_stats(urls, reset=True)
                async with RunningRouter(spec, urls, rust_venv, logs) as router:
                    run = await run_workload(spec, router.url, cfg, WORKLOADS[w], args.replicas, args.budget,
                                             args.seed, args.block_size, args.timeout_s, tick)
                await asyncio.sleep(0.2)
                result["workloads"].setdefault(w, {})[spec.name] = summarize(run, await replica_stats(urls))


async def main(args: argparse.Namespace) -> dict:
    from replicas.tiny_model.generate import ensure_tiny_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    tokenizer = str(await asyncio.to_thread(ensure_tiny_model))
    specs = [s for s in ALL if not args.routers or any(r in s.name for r in args.routers)]
    rust_venv = Path(args.rust_venv).resolve()
    result = {"args": vars(args), "num_blocks": num_blocks(args, workload_config(args)), "workloads": {},
              "latency": {}}
    workloads = [] if args.latency_only else args.workloads
    total = sum(len(workloads) * args.budget * s.workloads + args.latency_n for s in specs)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()) as bar:
        task = bar.add_task("h2h", total=total)
        tick = lambda: bar.advance(task)  # noqa: E731
        if workloads:
            on_run = lambda d: bar.update(task, description=d)  # noqa: E731
            await run_workloads(args, specs, workloads, result, tokenizer, logs, on_run, tick)
        if args.latency_n:
            async with replica_process(1, 4096, args.block_size, "zero", tokenizer, logs / "replica-zero.log") as zurls:
                for spec in specs:
                    bar.update(task, description=f"latency {spec.name}")
                    async with RunningRouter(spec, zurls, rust_venv, logs) as router:
                        lat = await measure(spec, router.url, zurls[0], args.latency_n, args.latency_tokens,
                                            args.seed, on_request=tick, pid=router.proc.pid)
                        if args.profile and spec.kind == "ours":  # a separate pass: sampling slows the machine
                            spy = profile.start(router.proc.pid, out, rust_venv)
                            await measure(spec, router.url, zurls[0], min(500, args.latency_n), args.latency_tokens,
                                          args.seed + 1)
                            lat["profile"] = profile.stop(spy)
                    result["latency"][spec.name] = lat
    (out / "h2h.json").write_text(json.dumps(result, indent=2))
    report.print_tables(result)
    return result


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.h2h", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--cache-ratio", type=float, default=0.5, help="KV per replica / the mix's live working set per replica")
    p.add_argument("--groups-per-replica", type=float, default=1.0)
    p.add_argument("--sessions-per-replica", type=float, default=3.0)
    p.add_argument("--tool-pause-s", type=float, default=0.05)
    p.add_argument("--budget", type=int, default=1024, help="requests per workload run")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--routers", nargs="*", default=[], help="substrings of router names to run (default: all)")
    p.add_argument("--latency-only", action="store_true",
                   help="only the router-added latency run (no workloads, no simulated fleet)")
    p.add_argument("--latency-n", type=int, default=2000, help="sequential requests of the latency run (0: skip)")
    p.add_argument("--latency-tokens", type=int, default=4000)
    p.add_argument("--profile", action="store_true", help="py-spy our router during the latency run")
    p.add_argument("--rust-venv", default=str(ROOT / ".venv-h2h"), help="venv with vllm-router, sglang-router, py-spy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=600.0, help="bound on one workload run")
    p.add_argument("--out", default=str(ROOT / "results" / "h2h"))
    return p.parse_args(argv)


def run(argv: list[str] | None = None) -> None:
    t = time.perf_counter()
    asyncio.run(main(parse(argv)))
    print(f"bench.h2h done in {time.perf_counter() - t:.0f} s")
