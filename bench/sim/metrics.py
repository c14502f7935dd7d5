"""What one fleet run measured, and its summary row.

* prefilled tokens: per engine, prompt tokens - prefix-cache hit tokens at first scheduling
  (as ``bench/demo.py`` reads ``vllm:prompt_tokens_total`` and ``vllm:prefix_cache_hits_total``).
* ideal: the same requests against one infinite cache shared by the whole fleet, with vLLM's
  rules (a hit stops at ``num_tokens - 1`` and at a scoring request's cap, block-rounded): each
  prompt block is computed once, ever (a new salt makes new blocks). Ratio >= 1 by construction.
* hit rate over time: prompt vs cached tokens per ``bucket_s`` window of request arrival.
* latencies: agent turn (issued -> reply done, router queueing included), GRPO group completion
  (first sample issued -> last done), scoring fan-out completion.
* router cost: wall-clock microseconds inside open + place + admit per decision (``decision``),
  and in finish / pump / end / scrapes (``other``).
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from bench.sim.engine import Engine, SimRequest
    from bench.sim.workloads import Item

_SYNTHETIC = 1 << 64


class Recorder:
    """Counters filled by the fleet loop; ``summary()`` is the table row."""

    def __init__(self, block_size: int, bucket_s: float, replicas: list[str]) -> None:
        """``block_size``: the engines' KV block in tokens; ``bucket_s``: the width of the
        hit-rate-over-time windows in simulated seconds; ``replicas``: the engines' names."""
        self.bs = block_size
        self.bucket_s = bucket_s
        self.replicas = replicas
        self.items_open = 0
        self.decisions = 0
        self.decision_s = 0.0
        self.other_s = 0.0
        self.open_s = 0.0
        self.requests = dict.fromkeys(replicas, 0)
        self.seen: set[int] = set()
        self.ideal_prefill = 0
        self.prompt_tokens = 0
        self.by_kind: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
        """Per workload (grpo, agent, opd): [prompt tokens, prefilled tokens, ideal prefilled tokens]."""
        self.windows: dict[int, list[int]] = defaultdict(lambda: [0, 0])
        self.latency: dict[str, list[float]] = defaultdict(list)
        self.updates: list[tuple[float, int]] = []
        self.engines: dict[str, dict] = {}
        self.end_s = 0.0

    def router_time(self, seconds: float, decision: bool, opening: bool = False) -> None:
        if opening:
            self.open_s += seconds
        if decision:
            self.decision_s += seconds
        else:
            self.other_s += seconds

    def dispatched(self, r: SimRequest, replica: str, now: float) -> None:
        self.requests[replica] += 1
        limit = r.prompt_tokens - 1 if r.cache_cap_tokens is None else min(r.prompt_tokens - 1, r.cache_cap_tokens)
        n_prompt = r.prompt_tokens // self.bs
        hit, seen = 0, self.seen
        for h in r.hashes[: max(0, limit) // self.bs]:
            if h not in seen:
                break
            hit += 1
        self.ideal_prefill += r.prompt_tokens - hit * self.bs
        self.by_kind[r.payload.item.workload][2] += r.prompt_tokens - hit * self.bs
        self.prompt_tokens += r.prompt_tokens
        seen.update(r.hashes[:n_prompt])

    def finished(self, r: SimRequest, replica: str, now: float) -> None:
        self.seen.update(h for h in r.hashes[r.prompt_tokens // self.bs:] if h < _SYNTHETIC)
        kind = self.by_kind[r.payload.item.workload]
        kind[0] += r.prompt_tokens
        kind[1] += r.prompt_tokens - r.cached_tokens
        w = self.windows[int(r.arrival_s // self.bucket_s)]
        w[0] += r.prompt_tokens
        w[1] += r.cached_tokens

    def item_done(self, item: Item, now: float) -> None:
        self.items_open -= 1
        self.latency[item.workload].append(now - item.created_s)

    def update_at(self, now: float, version: int) -> None:
        self.updates.append((now, version))

    def close(self, engines: list[Engine], now: float) -> None:
        self.end_s = now
        for e in engines:
            s = e.stats
            self.engines[e.name] = {"requests": self.requests[e.name], "prompt": s.prompt_tokens,
                                    "cached": s.cached_tokens, "prefilled": s.prefilled_tokens,
                                    "recomputed": s.recomputed_tokens, "preemptions": s.preemptions,
                                    "busy_s": s.busy_s}

    def summary(self, group_times: list[float]) -> dict:
        """One row: ratios, spread, latencies, preemptions, router cost; ``sim_s`` is the makespan
        (simulated seconds until the last client finished the same work) and ``busy_fraction`` the
        engines' mean share of it spent stepping."""
        e = self.engines
        prompt = sum(v["prompt"] for v in e.values())
        prefilled = sum(v["prefilled"] for v in e.values())
        reqs = np.array([v["requests"] for v in e.values()], float)
        pre = np.array([v["prefilled"] for v in e.values()], float)
        lat = {k: _pcts(v) for k, v in self.latency.items()}
        return {
            "requests": int(reqs.sum()), "prompt_tokens": prompt, "prefilled_tokens": prefilled,
            "ideal_prefilled_tokens": self.ideal_prefill,
            "prefilled_over_ideal": prefilled / self.ideal_prefill if self.ideal_prefill else float("nan"),
            "hit_rate": 1 - prefilled / prompt if prompt else 0.0,
            "busiest_over_mean_requests": _spread(reqs), "busiest_over_mean_prefill": _spread(pre),
            "turn_p50_s": lat.get("agent", (None, None))[0], "turn_p99_s": lat.get("agent", (None, None))[1],
            "group_p50_s": _pcts(group_times)[0], "group_p99_s": _pcts(group_times)[1],
            "score_p50_s": lat.get("opd", (None, None))[0],
            "preemptions": sum(v["preemptions"] for v in e.values()),
            "recomputed_tokens": sum(v["recomputed"] for v in e.values()),
            "decision_us": 1e6 * self.decision_s / max(1, self.decisions), "decisions": self.decisions,
            "place_admit_us": 1e6 * (self.decision_s - self.open_s) / max(1, self.decisions),
            "router_other_s": self.other_s, "sim_s": self.end_s,
            "busy_fraction": (sum(v["busy_s"] for v in e.values()) / (len(e) * self.end_s)
                              if e and self.end_s > 0 else 0.0),
            "by_workload": {k: {"prompt_tokens": v[0], "prefilled_tokens": v[1], "ideal_prefilled_tokens": v[2],
                                "prefilled_over_ideal": v[1] / v[2] if v[2] else float("nan")}
                            for k, v in sorted(self.by_kind.items())},
        }

    def hit_series(self) -> tuple[list[float], list[float]]:
        """(window start s, hit rate) over arrival time."""
        keys = sorted(self.windows)
        return ([k * self.bucket_s for k in keys],
                [self.windows[k][1] / self.windows[k][0] if self.windows[k][0] else 0.0 for k in keys])


def _spread(x: np.ndarray) -> float:
    return float(x.max() / x.mean()) if len(x) and x.mean() > 0 else float("nan")


def _pcts(v: list[float]) -> tuple[float | None, float | None]:
    if not v:
        return None, None
    a = np.asarray(v)
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))
