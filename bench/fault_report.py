"""What ``bench.fault`` prints: one run's records and replica counters summed up (pure: no I/O).

Figures (issue 12): requests failed by kind and status; scoring requests lost or partial (a
non-200, or a 200 whose rows are missing; target 0) and scoring rows that differ from the run
without the fault; failed attempts before a session moved off the killed replica (target 1);
seconds from the kill until the killed replica served again; duplicate decodes (tokens decoded
by a live replica that no client received; target 0); prefilled tokens (prompt tokens minus
prefix-cache hits, from the replicas' own counters).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from bench.fault_load import Record
from replicas.metrics import VllmMetrics, delta


@dataclass(frozen=True)
class Window:
    """One replica's counters over one stretch of its life (``before`` -> ``after``)."""

    replica: str
    before: VllmMetrics
    after: VllmMetrics
    served_since: float = float("-inf")
    """Records of this replica answered before this moment belong to an earlier stretch (a restart)."""
    decodes_checked: bool = True
    """False for a stretch that ended in a kill: what the killed engine decoded for requests that
    then failed over is lost with it, not decoded twice."""


@dataclass
class RunSummary:
    """One run (with or without the fault), as printed."""

    name: str
    requests: dict[str, int]
    failed: dict[str, int]
    scoring_lost_or_partial: int
    scoring_mismatch: int
    prompt_tokens: int
    prefilled_tokens: int
    duplicate_decode_tokens: int
    wall_s: float
    failed_over: int | None = None
    """Placements that failed on the killed replica and were run again elsewhere (``X-Rollout-Attempt`` - 1)."""
    moved_sessions: dict[int, int] = field(default_factory=dict)
    """Failed attempts before a session moved off the killed replica -> sessions."""
    kill_to_restarted_s: float | None = None
    kill_to_served_s: float | None = None
    served_by_probe: bool = False
    """True when the load had ended before the replica was back: a probe request measured it."""


def summarize(name: str, records: list[Record], windows: list[Window], wall_s: float,
              victim: str | None = None, killed_at: float | None = None,
              restarted_at: float | None = None) -> RunSummary:
    """Sum one run up; ``windows``: every stretch of every replica's counters in the run (the
    killed replica: before the kill, and since its restart)."""
    failed = Counter(f"{r.kind} {r.status if r.status > 0 else 'no answer'}" for r in records if r.status != 200)
    scores = [r for r in records if r.kind == "score"]
    diffs = [delta(w.after, w.before) for w in windows]
    prompt = sum(d.prompt_tokens for d in diffs)
    summary = RunSummary(
        name=name, requests=dict(Counter(r.kind for r in records)), failed=dict(sorted(failed.items())),
        scoring_lost_or_partial=sum(1 for r in scores if r.status != 200 or r.problem == "partial"),
        scoring_mismatch=sum(1 for r in scores if r.problem == "mismatch"),
        prompt_tokens=prompt, prefilled_tokens=prompt - sum(d.prefix_cache_hits for d in diffs),
        duplicate_decode_tokens=duplicate_decodes(records, windows), wall_s=round(wall_s, 1))
    if victim is not None and killed_at is not None:
        summary.moved_sessions = moved_sessions(records, victim, killed_at)
        summary.failed_over = sum(r.attempt - 1 for r in records if r.attempt > 1)
        if restarted_at is not None:
            summary.kill_to_restarted_s = round(restarted_at - killed_at, 1)
        since = restarted_at if restarted_at is not None else killed_at  # its new incarnation
        served = [r.done for r in records if r.replica == victim and r.status == 200 and r.sent > killed_at
                  and r.done >= since]
        summary.kill_to_served_s = round(min(served) - killed_at, 1) if served else None
    return summary


def duplicate_decodes(records: list[Record], windows: list[Window]) -> int:
    """Tokens the replicas decoded (``vllm:generation_tokens_total``) minus the tokens their clients
    received, over each window that did not end in a kill: > 0 means some request was decoded
    twice, or left decoding."""
    extra = 0
    for w in (w for w in windows if w.decodes_checked):
        received = sum(r.decoded for r in records if r.replica == w.replica and r.status == 200
                       and r.done >= w.served_since)
        extra += (w.after.generation_tokens - w.before.generation_tokens) - received
    return extra


def moved_sessions(records: list[Record], victim: str, killed_at: float) -> dict[int, int]:
    """For each session served by ``victim`` before the kill that went on after it: the failed
    attempts (earlier placements of a turn, and failed turns) until its first turn served elsewhere."""
    out: Counter = Counter()
    for key in {r.key for r in records if r.kind == "session"}:
        turns = sorted((r for r in records if r.key == key), key=lambda r: r.sent)
        before = [r for r in turns if r.done < killed_at and r.status == 200]
        after = [r for r in turns if r.done >= killed_at]
        if not before or before[-1].replica != victim or not after:
            continue
        failures = 0
        for turn in after:
            failures += (turn.attempt - 1) if turn.status == 200 else 1
            if turn.status == 200 and turn.replica != victim:
                break
        out[failures] += 1
    return dict(sorted(out.items()))


def render(runs: list[RunSummary], command: str) -> str:
    """The side-by-side table (one column per run)."""
    rows = [
        ("requests (session/group/score)", lambda s: "/".join(str(s.requests.get(k, 0))
                                                              for k in ("session", "group", "score"))),
        ("failed, by kind and status", lambda s: ", ".join(f"{k}: {v}" for k, v in s.failed.items()) or "0"),
        ("requests failed over (attempts on the victim)", lambda s: _opt(s.failed_over)),
        ("scoring lost or partial (target 0)", lambda s: s.scoring_lost_or_partial),
        ("scoring rows != no-fault run", lambda s: s.scoring_mismatch),
        ("failed attempts before a session moved (target 1)",
         lambda s: ", ".join(f"{k}: {v} sessions" for k, v in s.moved_sessions.items()) or "-"),
        ("s from kill to restarted (new URL)", lambda s: _opt(s.kill_to_restarted_s)),
        ("s from kill until it served again", lambda s: _opt(s.kill_to_served_s) + (" (probe)" if s.served_by_probe
                                                                                    else "")),
        ("duplicate decoded tokens (target 0)", lambda s: s.duplicate_decode_tokens),
        ("prompt tokens (replica counters)", lambda s: f"{s.prompt_tokens:,}"),
        ("prefilled tokens (replica counters)", lambda s: f"{s.prefilled_tokens:,}"),
        ("wall s", lambda s: s.wall_s),
    ]
    width = max(len(label) for label, _ in rows) + 2
    col = max(24, *(len(str(fn(s))) + 2 for _, fn in rows for s in runs))
    lines = [f"Fault run vs the same run without the fault ({command})",
             "".ljust(width) + "".join(s.name.rjust(col) for s in runs)]
    lines += [label.ljust(width) + "".join(str(fn(s)).rjust(col) for s in runs) for label, fn in rows]
    if len(runs) == 2 and runs[0].prefilled_tokens:
        ratio = runs[1].prefilled_tokens / runs[0].prefilled_tokens
        lines.append(f"prefilled tokens, fault / no fault = {ratio:.3f}")
    return "\n".join(lines)


def _opt(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"
