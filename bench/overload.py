"""Overload: many concurrent long sessions on replicas with a small KV cache, admission on vs off.

For each router (admission on at each watermark, then off) the replicas' prefix caches are
reset, a fresh router is started on the same replicas, every session runs its turns (a 429 is
retried after its Retry-After), and the replicas' own counters are diffed: prompt tokens,
prefix-cache hits, preemptions (``vllm:num_preemptions_total``). The client side adds the latency of continuing
turns (first attempt to answer, retries included), re-prefills (continuing turns that found
less than the previous turn's prompt cached) and 429s; a sampler records peak KV usage.

    .venv/bin/python -m bench.overload                   # starts 1 small-KV replica
    .venv/bin/python -m bench.overload --urls http://127.0.0.1:8100 --watermarks 0.85

The watermark is the headroom left for live sessions to grow: sessions admitted while their
first turns fit keep their prefixes only if their later turns fit too.
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
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

from bench.client import complete
from bench.workloads import random_tokens
from replicas.config import ReplicaSetConfig
from replicas.metrics import VllmMetrics, delta
from replicas.ops import fetch_metrics, reset_prefix_cache
from replicas.replica_set import ReplicaEndpoint, ReplicaSet
from router.cli import add_dataclass_flags, dataclass_overrides
from router.config import AppConfig
from router.server import running_router, tokenizer_path
from router.tokenize import PromptTokenizer


@dataclass(frozen=True)
class OverloadWorkload:
    """``num_sessions`` agent sessions at once, each ``turns`` turns long, on a small KV cache."""

    num_sessions: int = 12
    turns: int = 4
    first_prompt_tokens: int = 480
    observation_tokens: int = 96
    reply_tokens: int = 48
    think_s: float = 0.05
    """Pause between a reply and the next turn (the environment's step)."""
    retry_cap_s: float = 1.0
    """Longest wait honoured from a Retry-After header before retrying a 429."""
    seed: int = 3


@dataclass(frozen=True)
class OverloadResult:
    """One router's run, from the replicas' counters and the client's records."""

    router: str
    turns: int
    prompt_tokens: int
    prefix_cache_hits: int
    prefilled_tokens: int
    hit_rate: float
    preemptions: int
    reprefills: int
    rejected_429: int
    continuing_p50_s: float
    continuing_p99_s: float
    peak_kv_usage: float
    wall_s: float


@dataclass
class _Turn:
    session: int
    turn: int
    latency_s: float
    cached: int
    previous_prompt: int
    retries: int


@dataclass
class _Client:
    http: aiohttp.ClientSession
    url: str
    w: OverloadWorkload
    vocab: int
    block: int
    turns: list[_Turn] = field(default_factory=list)
    rejected: int = 0

    async def session(self, s: int) -> None:
        rng = random.Random(self.w.seed * 1000 + s)
        prompt = random_tokens(rng, self.w.first_prompt_tokens, self.vocab)
        headers = {"X-Session-Id": f"overload-{self.w.seed}-{s}"}
        previous = 0
        for turn in range(self.w.turns):
            rec, reply = await complete(self.http, self.url, prompt, self.w.reply_tokens, headers, "overload",
                                        f"s{s}", retry_cap_s=self.w.retry_cap_s)
            self.rejected += rec.retries
            self.turns.append(_Turn(s, turn, rec.latency_s, rec.cached_tokens, previous, rec.retries))
            previous = len(prompt)
            prompt = prompt + reply + random_tokens(rng, self.w.observation_tokens, self.vocab)
            await asyncio.sleep(self.w.think_s)

    def reprefills(self) -> int:
        """Continuing turns that found less cached than the previous turn's full blocks."""
        return sum(1 for t in self.turns if t.turn and t.cached < (t.previous_prompt // self.block) * self.block)

    def continuing_latencies(self) -> list[float]:
        return sorted(t.latency_s for t in self.turns if t.turn)


async def _metrics(http: aiohttp.ClientSession, endpoints: Sequence[ReplicaEndpoint]) -> dict[str, VllmMetrics]:
    values = await asyncio.gather(*(fetch_metrics(http, ep.base_url) for ep in endpoints))
    return {ep.replica_id: m for ep, m in zip(endpoints, values)}


async def _sample_peak(http: aiohttp.ClientSession, endpoints: Sequence[ReplicaEndpoint], peak: list[float],
                       interval_s: float = 0.1) -> None:
    while True:
        for m in (await _metrics(http, endpoints)).values():
            peak[0] = max(peak[0], m.kv_cache_usage)
        await asyncio.sleep(interval_s)


async def run_one(cfg: AppConfig, endpoints: Sequence[ReplicaEndpoint], tokenizer: PromptTokenizer,
                  w: OverloadWorkload, admission: bool) -> OverloadResult:
    """Reset the caches, run ``w`` through a fresh router with admission on or off, diff counters."""
    name = f"on @{cfg.policy.high_watermark:g}" if admission else "admission off"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as http:
        for ok in await asyncio.gather(*(reset_prefix_cache(http, ep.base_url) for ep in endpoints)):
            if not ok:
                raise RuntimeError("a replica refused to reset its prefix cache; results would be skewed")
        before, peak = await _metrics(http, endpoints), [0.0]
        sampler = asyncio.create_task(_sample_peak(http, endpoints, peak))
        started = time.perf_counter()
        try:
            run_cfg = cfg.replace(router={"admission": admission, "port": 0})
            async with running_router(run_cfg, endpoints, tokenizer) as (url, _):
                client = _Client(http, url, w, tokenizer.vocab_size, endpoints[0].block_size)
                await asyncio.gather(*(client.session(s) for s in range(w.num_sessions)))
        finally:
            sampler.cancel()
        wall = time.perf_counter() - started
        await asyncio.sleep(0.5)  # let the engines publish their last counters
        after = await _metrics(http, endpoints)
    return _summarize(name, client, before, after, peak[0], wall)


def _summarize(name: str, client: _Client, before: dict[str, VllmMetrics], after: dict[str, VllmMetrics],
               peak: float, wall: float) -> OverloadResult:
    diffs = [delta(after[rid], before[rid]) for rid in after]
    prompt, hits = sum(d.prompt_tokens for d in diffs), sum(d.prefix_cache_hits for d in diffs)
    queries = sum(d.prefix_cache_queries for d in diffs)
    lat = client.continuing_latencies()
    return OverloadResult(
        router=name, turns=len(client.turns), prompt_tokens=prompt, prefix_cache_hits=hits,
        prefilled_tokens=prompt - hits, hit_rate=round(hits / queries, 4) if queries else 0.0,
        preemptions=sum(d.num_preemptions for d in diffs), reprefills=client.reprefills(),
        rejected_429=client.rejected, continuing_p50_s=round(statistics.median(lat), 3) if lat else 0.0,
        continuing_p99_s=round(_quantile(lat, 0.99), 3) if lat else 0.0, peak_kv_usage=round(peak, 3),
        wall_s=round(wall, 2))


def _quantile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


async def compare(cfg: AppConfig, endpoints: Sequence[ReplicaEndpoint], w: OverloadWorkload,
                  tokenizer: PromptTokenizer | None = None, watermarks: Sequence[float] = ()) -> list[OverloadResult]:
    """Admission on (at ``cfg``'s watermark, or at each of ``watermarks``), then off, on the same replicas."""
    tokenizer = tokenizer or PromptTokenizer(tokenizer_path(cfg))
    configs = [cfg.replace(policy={"high_watermark": m}) for m in watermarks] or [cfg]
    results = [await run_one(c, endpoints, tokenizer, w, True) for c in configs]
    return results + [await run_one(cfg, endpoints, tokenizer, w, False)]


def render(results: list[OverloadResult]) -> str:
    """Side-by-side table, one column per router."""
    rows = [("prompt tokens", "prompt_tokens"), ("prefilled tokens", "prefilled_tokens"),
            ("prefix-cache hit rate", "hit_rate"), ("preemptions", "preemptions"),
            ("re-prefilled continuing turns", "reprefills"), ("429s (retried)", "rejected_429"),
            ("continuing turn p50 s", "continuing_p50_s"), ("continuing turn p99 s", "continuing_p99_s"),
            ("peak KV usage", "peak_kv_usage"), ("turns", "turns"), ("wall s", "wall_s")]
    width = max(len(label) for label, _ in rows) + 2
    lines = ["Overload: admission on (@ watermark) vs off; replica counters from /metrics",
             "".ljust(width) + "".join(r.router.rjust(16) for r in results)]
    for label, attr in rows:
        lines.append(label.ljust(width) + "".join(str(getattr(r, attr)).rjust(16) for r in results))
    return "\n".join(lines)


SMALL_KV = ReplicaSetConfig(num_replicas=1, max_model_len=2048, extra_args=("--num-gpu-blocks-override", "128"))
"""One replica with 128 blocks of 32 tokens (4,096 tokens of KV cache)."""


async def main_async(args: argparse.Namespace) -> list[OverloadResult]:
    w = OverloadWorkload(**dataclass_overrides(args, OverloadWorkload))
    replicas = SMALL_KV if not args.urls else ReplicaSetConfig(urls=tuple(args.urls))
    policy = {"session_idle_s": args.session_idle_s, "queue_timeout_s": args.queue_timeout_s}
    cfg = AppConfig().replace(policy=policy, router={"scrape_interval_s": 0.2})
    cfg = AppConfig(router=cfg.router, replicas=replicas, policy=cfg.policy)
    async with ReplicaSet(replicas) as rs:
        results = await compare(cfg, rs.endpoints, w, watermarks=args.watermarks)
    print(render(results))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"workload": asdict(w), "results": [asdict(r) for r in results]},
                                             indent=2))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.overload", description=__doc__.splitlines()[0])
    add_dataclass_flags(parser, OverloadWorkload)
    parser.add_argument("--urls", nargs="*", default=None, help="existing vLLM servers (default: start one)")
    parser.add_argument("--watermarks", type=float, nargs="+", default=[0.85, 0.6],
                        help="policy.high_watermark of each admission-on run")
    parser.add_argument("--session-idle-s", type=float, default=2.0, help="policy.session_idle_s")
    parser.add_argument("--queue-timeout-s", type=float, default=10.0, help="policy.queue_timeout_s")
    parser.add_argument("--out", default="results/overload.json")
    asyncio.run(main_async(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
