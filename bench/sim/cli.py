"""``python -m bench.sim``: simulate a fleet of vLLM engines under ours and the baselines."""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from bench.argtypes import at_least, non_negative
from bench.console import wide_console_width
from bench.sim.fleet import FleetConfig
from bench.sim.report import plot, render, write_json
from bench.sim.runs import DEFAULT_POLICIES, KINDS, ROUTERS, engine_config, execute, make_runs
from bench.sim.workloads import WorkloadConfig


def _ints(s: str) -> list[int]:
    try:
        out = [int(x) for x in s.split(",")]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from exc
    if any(x < 1 for x in out):
        raise argparse.ArgumentTypeError(f"values must be >= 1, got {s!r}")
    return out


def _floats(s: str) -> list[float]:
    try:
        out = [float(x) for x in s.split(",")]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}") from exc
    if any(x <= 0 for x in out):
        raise argparse.ArgumentTypeError(f"values must be > 0, got {s!r}")
    return out


def _names(valid) -> callable:
    def parse(s: str) -> list[str]:
        out = s.split(",")
        bad = [x for x in out if x not in valid]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {', '.join(valid)}")
        return out
    return parse


def _range(s: str) -> tuple[int, int]:
    lo, _, hi = s.partition("-")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected LOW-HIGH tokens, got {s!r}") from exc
    if not 1 <= a <= b:
        raise argparse.ArgumentTypeError(f"expected 1 <= LOW <= HIGH, got {s!r}")
    return a, b


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.sim", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                description=__doc__ + (
        " Prints one row per scale, workload, version policy, working-set ratio and router: prefilled "
        "tokens / ideal, hit rate, busiest replica / mean, latencies, preemptions, router µs per decision; "
        "writes JSON and PNGs under --out."))
    w = WorkloadConfig()
    p.add_argument("--replicas", type=_ints, default=[4], help="fleet sizes, e.g. 4,64,1024")
    p.add_argument("--workloads", type=_names(list(KINDS)), default=["mixed"], help=f"any of {','.join(KINDS)}")
    p.add_argument("--policies", type=_names(list(ROUTERS)), default=DEFAULT_POLICIES,
                   help="routers to compare (ours_no_admission: ours with admission off, placement alone)")
    p.add_argument("--requests", type=at_least(1), default=20_000, help="engine requests per run (a fan-out counts K)")
    p.add_argument("--ws-over-kv", type=_floats, default=[2.0],
                   help="live working set / fleet KV capacity (2 = caches hold half of it), e.g. 0.5,1,2; a replica "
                        "never gets less than two of the largest requests, so the table shows the ratio as sized "
                        "(a note follows the table when that floor, not the ratio, sized the caches)")
    p.add_argument("--update-every", type=at_least(0), default=4, help="trainer steps between weight updates (0: none)")
    p.add_argument("--weight-policy", default="keep+salt", choices=["flush", "keep", "salt", "keep+salt"],
                   help="version policy of the mixed workload (updates runs all four)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=at_least(1), default=16)
    p.add_argument("--max-num-seqs", type=at_least(1), default=256)
    p.add_argument("--token-budget", type=at_least(1), default=8192, help="max_num_batched_tokens per step")
    p.add_argument("--group-size", type=at_least(1), default=w.group_size)
    p.add_argument("--groups-per-replica", type=float, default=w.groups_per_replica)
    p.add_argument("--grpo-prompt", type=_range, default=w.grpo_prompt, help="tokens, LOW-HIGH")
    p.add_argument("--sessions-per-replica", type=float, default=w.sessions_per_replica)
    p.add_argument("--turns", type=at_least(1), default=w.turns)
    p.add_argument("--tool-pause-s", type=non_negative, default=w.tool_pause_s)
    p.add_argument("--contexts-per-replica", type=float, default=w.contexts_per_replica)
    p.add_argument("--fan-out", type=at_least(1), default=w.fan_out, help="OPD responses scored per context")
    p.add_argument("--out", type=Path, default=Path("results/sim"))
    return p


def main(argv: list[str] | None = None) -> list[dict]:
    args = parser().parse_args(argv)
    console = Console(width=wide_console_width(280))
    w = WorkloadConfig(group_size=args.group_size, groups_per_replica=args.groups_per_replica,
                       grpo_prompt=args.grpo_prompt, sessions_per_replica=args.sessions_per_replica,
                       turns=args.turns, tool_pause_s=args.tool_pause_s,
                       contexts_per_replica=args.contexts_per_replica, fan_out=args.fan_out)
    base = FleetConfig(engine=engine_config(args.block_size, args.max_num_seqs, args.token_budget), workload=w,
                       requests=args.requests, seed=args.seed)
    runs = make_runs(args.replicas, args.workloads, args.policies, args.ws_over_kv, base, args.update_every,
                     args.weight_policy)
    rows, series, spread = [], [], []
    cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*cols, console=console) as progress:
        for run in runs:
            task = progress.add_task(run.label, total=run.cfg.requests)
            started = time.perf_counter()
            row, fleet = execute(run, lambda n, task=task: progress.advance(task, n))
            row["wall_s"] = round(time.perf_counter() - started, 1)
            progress.update(task, completed=run.cfg.requests)
            rows.append(row)
            t, hr = fleet.rec.hit_series()
            series.append({"label": run.label, "t": t, "hit_rate": hr, "updates": [u[0] for u in fleet.rec.updates]})
            spread.append({"label": run.label, "prefilled": [v["prefilled"] for v in fleet.rec.engines.values()]})
    render(rows, console)
    for row in rows:
        if abs(row["ws_over_kv_actual"] / row["ws_over_kv"] - 1) > 0.1:
            console.print(f"note: N={row['scale']} {row['workload']} asked ws/kv={row['ws_over_kv']:g} but ran at "
                          f"{row['ws_over_kv_actual']:.2f}: the per-replica floor (two of the largest requests) sized "
                          "the caches; raise the in-flight counts per replica to run at the ratio asked")
    out = args.out
    write_json(rows, series, spread, {k: str(v) for k, v in vars(args).items()} | {"workload": asdict(w)},
               out / "sim.json")
    paths = plot(rows, [s for s, r in zip(series, rows) if r["updates"]], spread, out)
    console.print(f"wrote {out / 'sim.json'} and {', '.join(map(str, paths))}")
    return rows
