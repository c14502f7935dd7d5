"""The main job: real vLLM replicas behind the router, GRPO and agent traffic, vs round-robin.

For each (workload, router) pair the replicas' prefix caches are reset, a fresh router is
started on the same replicas, the workload runs, and the replicas' own counters
(``vllm:prompt_tokens_total``, ``vllm:prefix_cache_hits_total``, ``..._queries_total``) are
diffed. Prefilled tokens = prompt tokens - prefix-cache hit tokens.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import aiohttp
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from bench.client import RequestRecord, run_agent, run_grpo
from bench.workloads import AgentWorkload, GrpoWorkload
from replicas.metrics import VllmMetrics, delta
from replicas.ops import fetch_metrics, reset_prefix_cache
from replicas.replica_set import ReplicaEndpoint, ReplicaSet
from router.config import AppConfig
from router.server import running_router, tokenizer_path
from router.tokenize import PromptTokenizer


@dataclass(frozen=True)
class RunResult:
    """One workload under one router, measured by the replicas' own metrics."""

    workload: str
    router: str
    requests: int
    prompt_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefilled_tokens: int
    requests_per_replica: dict[str, int]
    wall_s: float
    prefilled_per_replica: dict[str, int]
    """Prompt tokens each replica computed (its prompt tokens minus its prefix-cache hits): where
    the routers differ, as both spread requests evenly."""


async def _all_metrics(http: aiohttp.ClientSession, endpoints: Sequence[ReplicaEndpoint]) -> dict[str, VllmMetrics]:
    values = await asyncio.gather(*(fetch_metrics(http, ep.base_url) for ep in endpoints))
    return {ep.replica_id: m for ep, m in zip(endpoints, values)}


async def run_one(cfg: AppConfig, endpoints: Sequence[ReplicaEndpoint], tokenizer: PromptTokenizer,
                  policy: str, workload: GrpoWorkload | AgentWorkload, progress: Progress,
                  label: str = "") -> RunResult:
    """Reset caches, run ``workload`` through a fresh router with ``policy``, diff the metrics.
    ``label``: the progress bar's name (default: the workload's)."""
    name = "grpo" if isinstance(workload, GrpoWorkload) else "agent"
    total = (workload.num_prompts * workload.group_size if name == "grpo"
             else workload.num_sessions * workload.turns)
    task = progress.add_task(f"{label or name:5s} via {policy}", total=total)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as http:
        for ok in await asyncio.gather(*(reset_prefix_cache(http, ep.base_url) for ep in endpoints)):
            if not ok:
                raise RuntimeError("a replica refused to reset its prefix cache; results would be skewed")
        before = await _all_metrics(http, endpoints)
        started = time.perf_counter()
        async with running_router(cfg.replace(router={"policy": policy, "port": 0}), endpoints, tokenizer) as (url, _):
            runner = run_grpo if name == "grpo" else run_agent
            records = await runner(http, url, workload, tokenizer.vocab_size,
                                   lambda n: progress.advance(task, n))
        wall = time.perf_counter() - started
        await asyncio.sleep(0.5)  # let the engines publish their last counters
        after = await _all_metrics(http, endpoints)
    return _summarize(name, policy, records, before, after, wall)


def _summarize(name: str, policy: str, records: list[RequestRecord], before: dict[str, VllmMetrics],
               after: dict[str, VllmMetrics], wall: float) -> RunResult:
    diffs = [delta(after[rid], before[rid]) for rid in after]
    prompt = sum(d.prompt_tokens for d in diffs)
    hits = sum(d.prefix_cache_hits for d in diffs)
    per_replica = {rid: sum(1 for r in records if r.replica == rid) for rid in sorted(after)}
    prefilled = {rid: d.prompt_tokens - d.prefix_cache_hits for rid, d in zip(after, diffs)}
    return RunResult(name, policy, len(records), prompt, sum(d.prefix_cache_queries for d in diffs), hits,
                     prompt - hits, per_replica, round(wall, 2), {rid: prefilled[rid] for rid in sorted(prefilled)})


def render(results: list[RunResult], console: Console) -> dict[str, float]:
    """Print the comparison table; return prefilled-token ratios ours / round-robin per workload."""
    table = Table(title="Prefix reuse on real vLLM replicas (counters from each replica's /metrics)")
    for col in ("workload", "router", "requests", "prompt tokens", "cache hits", "prefilled",
                "per replica: requests / prefilled", "wall s"):
        table.add_column(col, justify="left" if col in ("workload", "router") or col.startswith("per") else "right")
    for r in results:
        table.add_row(r.workload, r.router, str(r.requests), f"{r.prompt_tokens:,}", f"{r.prefix_cache_hits:,}",
                      f"{r.prefilled_tokens:,}",
                      "\n".join(f"{k}: {n} / {r.prefilled_per_replica.get(k, 0):,}" for k, n in r.requests_per_replica.items()),
                      f"{r.wall_s:.1f}")
    console.print(table)
    ratios = {}
    for w in dict.fromkeys(r.workload for r in results):  # in the table's order
        by = {r.router: r for r in results if r.workload == w}
        if "prefix_affinity" in by and "round_robin" in by and by["round_robin"].prefilled_tokens:
            ratios[w] = by["prefix_affinity"].prefilled_tokens / by["round_robin"].prefilled_tokens
            console.print(f"[bold]{w}[/bold]: prefilled tokens ours / round-robin = {ratios[w]:.3f} "
                          f"({by['prefix_affinity'].prefilled_tokens:,} vs {by['round_robin'].prefilled_tokens:,})")
    return ratios


def plot(results: list[RunResult], path: Path) -> None:
    """Bar chart of prefilled tokens per workload and router."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r.workload for r in results))  # in the table's order
    routers = list(dict.fromkeys(r.router for r in results))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.8 / len(routers)
    for i, router in enumerate(routers):
        values = [next((r.prefilled_tokens for r in results if r.workload == w and r.router == router), 0)
                  for w in workloads]
        ax.bar([x + i * width for x in range(len(workloads))], values, width, label=router)
    ax.set_xticks([x + width * (len(routers) - 1) / 2 for x in range(len(workloads))], workloads)
    ax.set_ylabel("prefilled tokens (lower is better)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


async def run_demo(cfg: AppConfig, grpo: GrpoWorkload, agent: AgentWorkload, out: Path,
                   routers: Sequence[str] = ("prefix_affinity", "round_robin")) -> dict:
    """Start the replicas, run both workloads under each router, print and save the results."""
    console = Console(width=150)
    console.print(f"starting {cfg.replicas.replica_count} vLLM replica(s) under Ray (about 2 minutes on 2 cores) ...")
    tokenizer = PromptTokenizer(tokenizer_path(cfg))
    async with ReplicaSet(cfg.replicas) as replica_set:
        endpoints = replica_set.endpoints
        console.print("replicas: " + ", ".join(f"{e.replica_id}={e.base_url}" for e in endpoints))
        results = []
        with Progress(console=console, transient=True) as progress:
            # untimed: the engines' first batches of each shape cost seconds (CPU kernels set up per
            # shape), which the first timed run would pay alone (its wall time read 5x the others)
            await run_one(cfg, endpoints, tokenizer, routers[-1], grpo, progress, label="warm-up")
            for workload in (grpo, agent):
                for policy in routers:
                    results.append(await run_one(cfg, endpoints, tokenizer, policy, workload, progress))
    ratios = render(results, console)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"results": [asdict(r) for r in results], "prefilled_ratio_ours_vs_round_robin": ratios,
              "grpo": asdict(grpo), "agent": asdict(agent)}
    out.write_text(json.dumps(report, indent=2))
    plot(results, out.with_suffix(".png"))
    console.print(f"wrote {out} and {out.with_suffix('.png')}")
    return report
