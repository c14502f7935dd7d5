"""The head-to-head tables: rich on the terminal, Markdown for the README."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from bench.console import wide_console_width


def rows(result: dict) -> list[list[str]]:
    """One row per workload and router: prefilled/ideal, busiest/mean (requests, prefill), errors."""
    out = []
    for w, by_router in result["workloads"].items():
        for name, r in by_router.items():
            errors = sum(r["errors"].values())
            out.append([w, name, f"{r['prefilled_over_ideal']:.3f}", f"{r['busiest_over_mean_requests']:.2f}",
                        f"{r['busiest_over_mean_prefill']:.2f}", str(r["requests_ok"]), str(r.get("retries", 0)),
                        str(errors)])
    return out


def latency_rows(result: dict) -> list[list[str]]:
    return [[name, f"{r['added_p50_ms']:+.2f}", f"{r['added_p99_ms']:+.2f}", f"{r['direct_p50_ms']:.2f}",
             _cpu(r)]
            for name, r in result["latency"].items()]


def _cpu(r: dict) -> str:
    """Router CPU per request, its user part in brackets (``-`` when not measured)."""
    if "router_cpu_ms_per_request" not in r:
        return "-"
    return f"{r['router_cpu_ms_per_request']:.2f} ({r.get('router_user_ms_per_request', 0):.2f} user)"


HEAD = ["workload", "router", "prefilled / ideal", "busiest / mean (requests)", "busiest / mean (prefill)",
        "ok", "retried 429/503", "errors"]
LAT_HEAD = ["router", "added p50 ms", "added p99 ms", "direct p50 ms", "router CPU ms / request (user)"]


def print_tables(result: dict) -> None:
    console = Console(width=wide_console_width(200))
    for title, head, body in (("Head-to-head on simulated replicas (bench.h2h)", HEAD, rows(result)),
                              ("Router-added latency (zero-cost replica, sequential token-ID prompts)",
                               LAT_HEAD, latency_rows(result))):
        if not body:
            continue
        t = Table(title=title)
        for h in head:
            t.add_column(h)
        for r in body:
            t.add_row(*r)
        console.print(t)
    console.print(markdown(result))


def markdown(result: dict) -> str:
    """Both tables as Markdown (pasted into README's Head-to-head section)."""
    lines = []
    for head, body in ((HEAD, rows(result)), (LAT_HEAD, latency_rows(result))):
        if body:
            lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            lines += ["| " + " | ".join(r) + " |" for r in body]
            lines.append("")
    return "\n".join(lines)
