"""The simulator's table, JSON and figures."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

COLUMNS = (
    ("N", "scale", "{}"), ("workload", "workload", "{}"), ("ver.", "weight_policy", "{}"),
    ("ws/kv", "ws_over_kv_actual", "{:.2f}"), ("policy", "policy", "{}"), ("requests", "requests", "{:,}"),
    ("prefilled/ideal", "prefilled_over_ideal", "{:.3f}"), ("hit rate", "hit_rate", "{:.3f}"),
    ("busiest/mean req", "busiest_over_mean_requests", "{:.2f}"),
    ("busiest/mean prefill", "busiest_over_mean_prefill", "{:.2f}"),
    ("turn p50/p99 s", "turn", "{}"), ("group p50/p99 s", "group", "{}"),
    ("makespan s", "sim_s", "{:.0f}"), ("engine busy", "busy_fraction", "{:.0%}"),
    ("preempt", "preemptions", "{:,}"), ("µs/decision", "decision_us", "{:.1f}"),
    ("µs place+admit", "place_admit_us", "{:.1f}"),
)


def _cell(row: dict, key: str, fmt: str) -> str:
    if key in ("turn", "group"):
        a, b = row.get(f"{key}_p50_s"), row.get(f"{key}_p99_s")
        return "-" if a is None else f"{a:.2f}/{b:.2f}"
    v = row.get(key)
    return "-" if v is None else fmt.format(v)


def render(rows: list[dict], console: Console) -> None:
    """One table row per (scale, workload, version policy, ws/kv, router)."""
    table = Table(title="Fleet simulator (bench.sim): prefilled tokens vs ideal, spread, latency, router cost")
    for head, _, _ in COLUMNS:
        table.add_column(head, justify="left" if head in ("workload", "policy", "ver.") else "right")
    for row in rows:
        table.add_row(*(_cell(row, k, f) for _, k, f in COLUMNS))
    console.print(table)
    by_kind = [r for r in rows if len(r.get("by_workload") or {}) > 1]
    if by_kind:
        console.print("prefilled/ideal by workload (the clients are closed-loop: the mix a run serves depends on the router)")
        for r in by_kind:
            console.print(f"  N={r['scale']} ws/kv={r['ws_over_kv_actual']:.2f} {r['policy']}: " + ", ".join(
                f"{k} {v['prefilled_over_ideal']:.3f} ({v['prompt_tokens'] / 1e6:.2f}M prompt)"
                for k, v in r["by_workload"].items()))
    cost = defaultdict(dict)
    for row in rows:
        cost[row["policy"]][row["scale"]] = row["place_admit_us"]
    if "ours" in cost and len(cost["ours"]) > 1:
        scales = sorted(cost["ours"])
        base = cost["ours"][scales[0]]
        console.print("ours, µs per decision in place+admit by N (open, which hashes the prompt, is N-independent): " + ", ".join(
            f"N={n}: {cost['ours'][n]:.1f} ({cost['ours'][n] / base:.2f}x N={scales[0]})" for n in scales))


def write_json(rows: list[dict], series: list[dict], spread: list[dict], args: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"args": args, "rows": rows, "hit_rate_series": series, "spread": spread}, indent=1))


def plot(rows: list[dict], series: list[dict], spread: list[dict], out: Path) -> list[Path]:
    """PNGs under ``out``: prefilled/ideal by policy and scale; hit rate over time across
    updates (only when ``series`` holds runs with updates); per-replica prefilled tokens
    (sorted) per policy (when ``spread``). Returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    policies = sorted({r["policy"] for r in rows})
    groups = sorted({(r["scale"], r["workload"], r["weight_policy"] or "", r["ws_over_kv"]) for r in rows})
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(groups)), 4))
    width = 0.8 / max(1, len(policies))
    for i, p in enumerate(policies):
        vals = [next((r["prefilled_over_ideal"] for r in rows if (r["scale"], r["workload"], r["weight_policy"] or "",
                                                                 r["ws_over_kv"]) == g and r["policy"] == p), 0)
                for g in groups]
        ax.bar([x + i * width for x in range(len(groups))], vals, width, label=p)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(groups))],
                  [f"N={g[0]}\n{g[1]}{'/' + g[2] if g[2] else ''}\nws/kv={g[3]:g}" for g in groups], fontsize=7)
    ax.axhline(1.0, color="k", lw=0.5)
    ax.set_ylabel("prefilled tokens / ideal (lower is better)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out / "prefilled_by_policy.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    if series:
        fig, ax = plt.subplots(figsize=(8, 4))
        for s in series:
            ax.plot(s["t"], s["hit_rate"], lw=0.8, label=s["label"])
            for t in s["updates"]:
                ax.axvline(t, color="grey", lw=0.3)
        ax.set_xlabel("simulated time (s); grey lines: weight updates")
        ax.set_ylabel("prefix-cache hit rate")
        ax.legend(fontsize=6)
        fig.tight_layout()
        paths.append(out / "hit_rate_over_time.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    if spread:
        fig, ax = plt.subplots(figsize=(7, 4))
        for s in spread:
            ax.plot(sorted(s["prefilled"], reverse=True), lw=1, label=s["label"])
        ax.set_xlabel("replica (sorted by prefilled tokens)")
        ax.set_ylabel("prefilled tokens")
        ax.legend(fontsize=6)
        fig.tight_layout()
        paths.append(out / "load_spread.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths
