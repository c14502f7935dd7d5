"""KV pressure: round-robin vs a predicted-only prefix index vs an index fed by vLLM's KV events.

Two small-KV replicas; agent sessions and GRPO groups run together with a live working set
(every live session's current prompt plus every running group's prompt) of about
``--pressure`` (default 1.5) times the replicas' total KV capacity, so the engines evict.
For each router the replicas' prefix caches are reset, a fresh router is started on the same
replicas and the same workload runs; reported side by side:

* prefilled tokens (``vllm:prompt_tokens_total`` - ``vllm:prefix_cache_hits_total``) and
  preemptions (``vllm:num_preemptions_total``), diffed from the replicas' ``/metrics``;
* index precision and recall against the engines' real contents, per request:
  ``hit = min(predicted, cached)`` with ``predicted`` the router's expected cached tokens and
  ``cached`` the replica's ``usage.prompt_tokens_details.cached_tokens``;
  precision = sum(hit) / sum(predicted), recall = sum(hit) / sum(cached); both ``n/a`` for a
  router without a prefix index (round-robin), which predicts nothing;
* p50 / p99 turn latency (client side, every request).

    flock /tmp/vllm.lock .venv/bin/python -m bench.kv_pressure            # starts 2 replicas
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from bench.client import RequestRecord, complete
from bench.workloads import random_tokens
from replicas.config import ReplicaSetConfig
from replicas.metrics import VllmMetrics, delta
from replicas.ops import fetch_metrics, reset_prefix_cache
from replicas.replica_set import ReplicaEndpoint, ReplicaSet
from router.cli import add_dataclass_flags, dataclass_overrides
from router.config import AppConfig
from router.server import running_router, tokenizer_path
from router.tokenize import PromptTokenizer

ROUTERS: dict[str, dict] = {
    "round-robin": {"policy": "round_robin", "kv_events": False},
    "predicted": {"policy": "prefix_affinity", "kv_events": False},
    "event-fed": {"policy": "prefix_affinity", "kv_events": True},
}


def has_index(name: str) -> bool:
    """Whether router ``name`` keeps a prefix index (``DecisionCore.prefix_index``: only
    prefix_affinity does); without one its precision and recall are not 0 but undefined."""
    return ROUTERS[name]["policy"] == "prefix_affinity"


@dataclass(frozen=True)
class PressureWorkload:
    """``num_sessions`` agent sessions (``turns`` turns, growing prompts) and ``num_groups``
    GRPO groups (``group_size`` samples of one prompt, ``concurrent_groups`` at a time), together."""

    num_sessions: int = 8
    turns: int = 4
    first_prompt_tokens: int = 640
    observation_tokens: int = 128
    reply_tokens: int = 32
    num_groups: int = 6
    group_size: int = 4
    group_prompt_tokens: int = 512
    concurrent_groups: int = 2
    seed: int = 14

    def live_tokens(self) -> int:
        """Peak live working set: every session at its last turn plus the running groups."""
        last = self.first_prompt_tokens + (self.turns - 1) * (self.reply_tokens + self.observation_tokens)
        return self.num_sessions * last + self.concurrent_groups * self.group_prompt_tokens


@dataclass(frozen=True)
class PressureResult:
    """One router's run."""

    router: str
    requests: int
    prompt_tokens: int
    prefilled_tokens: int
    preemptions: int
    precision: float | None
    recall: float | None
    predicted_tokens: int
    cached_tokens: int
    p50_s: float
    p99_s: float
    wall_s: float


async def _sessions(http, url: str, w: PressureWorkload, vocab: int) -> list[RequestRecord]:
    async def one(s: int) -> list[RequestRecord]:
        rng = random.Random(w.seed * 1000 + s)
        prompt, out = random_tokens(rng, w.first_prompt_tokens, vocab), []
        headers = {"X-Session-Id": f"kvp-{w.seed}-{s}"}
        for _ in range(w.turns):
            rec, reply = await complete(http, url, prompt, w.reply_tokens, headers, "agent", f"s{s}")
            out.append(rec)
            prompt = prompt + reply + random_tokens(rng, w.observation_tokens, vocab)
        return out

    return [r for recs in await asyncio.gather(*(one(s) for s in range(w.num_sessions))) for r in recs]


async def _groups(http, url: str, w: PressureWorkload, vocab: int) -> list[RequestRecord]:
    rng = random.Random(w.seed * 7 + 1)
    prompts = [random_tokens(rng, w.group_prompt_tokens, vocab) for _ in range(w.num_groups)]
    out: list[RequestRecord] = []

    async def group(g: int) -> None:
        headers = {"X-Group-Id": f"kvp-{w.seed}-{g}"}
        done = await asyncio.gather(*(complete(http, url, prompts[g], w.reply_tokens, headers, "grpo", f"g{g}")
                                      for _ in range(w.group_size)))
        out.extend(rec for rec, _ in done)

    for start in range(0, w.num_groups, w.concurrent_groups):
        await asyncio.gather(*(group(g) for g in range(start, min(w.num_groups, start + w.concurrent_groups))))
    return out


async def _metrics(http, endpoints: Sequence[ReplicaEndpoint]) -> dict[str, VllmMetrics]:
    values = await asyncio.gather(*(fetch_metrics(http, ep.base_url) for ep in endpoints))
    return {ep.replica_id: m for ep, m in zip(endpoints, values)}


async def run_one(name: str, cfg: AppConfig, endpoints: Sequence[ReplicaEndpoint], tokenizer: PromptTokenizer,
                  w: PressureWorkload, http: aiohttp.ClientSession, dump: dict | None = None) -> PressureResult:
    """Reset the caches, run ``w`` through a fresh router configured as ``ROUTERS[name]``
    (each request's record goes to ``dump[name]`` when given)."""
    for ok in await asyncio.gather(*(reset_prefix_cache(http, ep.base_url) for ep in endpoints)):
        if not ok:
            raise RuntimeError("a replica refused to reset its prefix cache; results would be skewed")
    before = await _metrics(http, endpoints)
    started = time.perf_counter()
    async with running_router(cfg.replace(router={**ROUTERS[name], "port": 0}), endpoints, tokenizer) as (url, _):
        await asyncio.sleep(1.0)  # the event-fed router's subscriptions join
        parts = await asyncio.gather(_sessions(http, url, w, tokenizer.vocab_size),
                                     _groups(http, url, w, tokenizer.vocab_size))
    wall = time.perf_counter() - started
    await asyncio.sleep(0.5)
    after = await _metrics(http, endpoints)
    records = [r for p in parts for r in p]
    if dump is not None:
        dump[name] = [asdict(r) for r in records]
    return summarize(name, records, before, after, wall)


def summarize(name: str, records: list[RequestRecord], before: dict[str, VllmMetrics],
              after: dict[str, VllmMetrics], wall: float) -> PressureResult:
    """Counters diffed per replica; precision/recall from each request's prediction and report
    (None, printed ``n/a``, when there is nothing to divide by or ``name`` has no index)."""
    diffs = [delta(after[rid], before[rid]) for rid in after]
    indexed = has_index(name)
    prompt = sum(d.prompt_tokens for d in diffs)
    predicted = sum(r.expected_cached_tokens for r in records)
    cached = sum(r.cached_tokens for r in records)
    hit = sum(min(r.expected_cached_tokens, r.cached_tokens) for r in records)
    lat = sorted(r.latency_s for r in records)
    return PressureResult(
        router=name, requests=len(records), prompt_tokens=prompt,
        prefilled_tokens=prompt - sum(d.prefix_cache_hits for d in diffs),
        preemptions=sum(d.num_preemptions for d in diffs),
        precision=round(hit / predicted, 4) if indexed and predicted else None,
        recall=round(hit / cached, 4) if indexed and cached else None,
        predicted_tokens=predicted, cached_tokens=cached,
        p50_s=round(statistics.median(lat), 3), p99_s=round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3),
        wall_s=round(wall, 1))


def render(results: list[PressureResult], capacity_tokens: int, live_tokens: int) -> str:
    """Side-by-side table, one column per router."""
    rows = [("requests", "requests"), ("prompt tokens", "prompt_tokens"), ("prefilled tokens", "prefilled_tokens"),
            ("preemptions", "preemptions"), ("index precision", "precision"), ("index recall", "recall"),
            ("predicted cached tokens", "predicted_tokens"), ("reported cached tokens", "cached_tokens"),
            ("turn p50 s", "p50_s"), ("turn p99 s", "p99_s"), ("wall s", "wall_s")]
    width = max(len(label) for label, _ in rows) + 2
    lines = [f"KV pressure: live working set {live_tokens} tokens = {live_tokens / capacity_tokens:.2f} x "
             f"the replicas' {capacity_tokens} KV tokens",
             "".ljust(width) + "".join(r.router.rjust(14) for r in results)]
    for label, attr in rows:
        cells = (str(getattr(r, attr) if getattr(r, attr) is not None else "n/a").rjust(14) for r in results)
        lines.append(label.ljust(width) + "".join(cells))
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> list[PressureResult]:
    w = PressureWorkload(**dataclass_overrides(args, PressureWorkload))
    blocks = max(8, round(w.live_tokens() / args.pressure / 2 / args.block_size))
    replicas = ReplicaSetConfig(num_replicas=2, max_model_len=2048, enable_plugin=False, block_size=args.block_size,
                                extra_args=("--num-gpu-blocks-override", str(blocks)))
    cfg = AppConfig(replicas=replicas).replace(router={"scrape_interval_s": 0.2, "admission": args.admission})
    tokenizer = PromptTokenizer(tokenizer_path(cfg))
    async with ReplicaSet(replicas) as rs:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900), middlewares=(rs.auth,)) as http:
            records: dict = {}
            results = [await run_one(name, cfg, rs.endpoints, tokenizer, w, http, records) for name in args.routers]
    print(render(results, 2 * blocks * args.block_size, w.live_tokens()))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"workload": asdict(w), "blocks_per_replica": blocks,
                                              "results": [asdict(r) for r in results], "requests": records}))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.kv_pressure", description=__doc__.splitlines()[0])
    add_dataclass_flags(parser, PressureWorkload)
    parser.add_argument("--pressure", type=float, default=1.5, help="live working set / total KV capacity")
    parser.add_argument("--block-size", type=int, default=32, help="KV block size in tokens")
    parser.add_argument("--admission", action="store_true", help="router admission control on (default off)")
    parser.add_argument("--routers", nargs="+", default=list(ROUTERS), choices=list(ROUTERS))
    parser.add_argument("--out", default="results/kv_pressure.json")
    asyncio.run(main_async(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
