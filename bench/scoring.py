"""OPD scoring benchmark: uncached vs S-bounded prefix reuse, on real vLLM, through /v1/score.

The seed's two workload shapes (seed 000, "What it actually did"), scaled to this machine, K = 4:

- long context / short responses: P ~ 3,000-4,000, R ~ 13-58
- short context / long responses: P ~ 140-210, R ~ 437-1,024

Each group starts from an empty prefix cache (the best of ``--repeats`` runs per mode counts, the
modes taking turns, which keeps other processes' noise out of the ratio) and is scored by the same replica, through
two routers: one that knows the replica's cap is active (forwards S, bounded reuse) and one that
does not (cache reads off, full recomputation). Printed per shape: wall time of each, the
speedup, the bound K(P + R) / (P + K R) from the actual token counts, speedup / bound, tokens
computed (prompt - cached, from the replica's own usage) vs the ideal after block rounding, and
the largest logprob difference between the two. The token-count bound ignores that a row
attends to every key before it; the FLOP bound (:class:`cache_policy.scoring.PrefillCost`, from
the served model's ``config.json``) weights each row by its linear + attention FLOPs.

Which model is served matters for what the ratio means. The seed's teacher (Qwen3-32B) spends
about 6% of a 3,500-token prefill's FLOPs in attention; the 128-wide test model about 65%, so on
it the rows reuse cannot skip (responses reading a long cached context) are its dearest ones,
and no implementation reaches the token bound. The default ``--model teacher``
(:meth:`TinyModelSpec.teacher_shaped`) has the 32B teacher's attention-to-linear FLOP ratio at
the cost of a 512-wide model; ``--model tiny`` and ``--model wide --width N`` serve the others.

    python -m bench.scoring                                     # teacher-shaped model, both shapes
    python -m bench.scoring --token-budget 2048                 # the seed's second row (vLLM-CPU's default)
    python -m bench.scoring --model tiny --groups 3 --repeats 3 # the attention-bound test model
    python -m bench.scoring --model wide --width 512 --shapes short
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from rich.console import Console
from rich.progress import Progress, TimeElapsedColumn
from rich.table import Table

from bench.argtypes import at_least
from cache_policy.scoring import TOKEN_COST, PrefillCost, ideal_computed_tokens, reuse_costs
from replicas.config import ReplicaSetConfig, parse_cpu_list
from replicas.ops import reset_prefix_cache
from replicas.replica_set import ReplicaEndpoint, ReplicaSet
from replicas.server import omp_threads_bind, resolve_model
from router.config import AppConfig
from router.server import running_router, tokenizer_path
from replicas.tiny_model import TinyModelSpec, ensure_tiny_model
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
SHAPE_KEYS = {"long": SHAPES[0], "short": SHAPES[1]}


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
    flop_num: float = 0.0
    flop_den: float = 0.0
    max_abs_diff: float = 0.0
    runs: list[dict[str, list[float]]] = dataclasses.field(default_factory=list)
    """Per group, every run's wall time (s) per mode; the tables use the best."""

    @property
    def speedup(self) -> float:
        """Sum over groups of each mode's best run: uncached / bounded."""
        return self.uncached_s / self.bounded_s

    @property
    def median_speedup(self) -> float:
        """The same from each mode's median run: how much the best-of figure owes to luck."""
        return (sum(statistics.median(g["uncached"]) for g in self.runs)
                / sum(statistics.median(g["bounded"]) for g in self.runs))

    @property
    def bound(self) -> float:
        """Token-count bound over all groups: sum of K(P + R) / sum of (P + K R)."""
        return self.bound_num / self.bound_den

    @property
    def flop_bound(self) -> float:
        """The same with rows weighted by :class:`PrefillCost` (attention grows with position)."""
        return self.flop_num / self.flop_den


def make_group(shape: Shape, rng: random.Random, vocab: int) -> tuple[list[int], list[list[int]]]:
    context = [rng.randrange(FIRST_TOKEN, vocab) for _ in range(rng.randint(*shape.context))]
    responses = [[rng.randrange(FIRST_TOKEN, vocab) for _ in range(rng.randint(*shape.response))]
                 for _ in range(shape.k)]
    return context, responses


async def _timed_score(http: aiohttp.ClientSession, url: str, ep: ReplicaEndpoint, context, responses):
    """Wall time of one ``/v1/score`` call from an empty prefix cache, and its answer."""
    if not await reset_prefix_cache(http, ep.base_url):
        raise RuntimeError(f"{ep.replica_id} refused to reset its prefix cache")
    started = time.perf_counter()
    async with http.post(url + "/v1/score", json={"context": context, "responses": responses}) as r:
        payload = await r.json()
        if r.status != 200:
            raise RuntimeError(f"/v1/score failed: {payload}")
    return time.perf_counter() - started, payload


async def _runs(http, urls: dict[str, str], ep: ReplicaEndpoint, context, responses, repeats: int,
                   advance: Callable[[], None] = lambda: None):
    """Per mode, the wall times of ``repeats`` runs (s) and the last answer. The modes alternate
    which goes first, so neither always runs on a warmer (or colder) process. ``advance`` is
    called after each run (the progress bar)."""
    times: dict[str, list[float]] = {mode: [] for mode in urls}
    answers: dict[str, dict] = {}
    for i in range(repeats):
        for mode in (list(urls) if i % 2 == 0 else list(urls)[::-1]):
            elapsed, answers[mode] = await _timed_score(http, urls[mode], ep, context, responses)
            times[mode].append(elapsed)
            advance()
    return times, answers


async def run_shape(http, urls: dict[str, str], ep: ReplicaEndpoint, shape: Shape, groups: int, vocab: int,
                    seed: int, repeats: int, cost: PrefillCost,
                    advance: Callable[[], None] = lambda: None) -> ShapeResult:
    rng = random.Random(seed)
    res = ShapeResult(shape.name, groups)
    for _ in range(groups):
        context, responses = make_group(shape, rng, vocab)
        times, answers = await _runs(http, urls, ep, context, responses, repeats, advance)
        res.runs.append(times)
        off, on = answers["uncached"], answers["bounded"]
        assert on["scoring_cap"] and not off["scoring_cap"], "bench needs a replica with an active cap"
        lens = [len(r) for r in responses]
        res.uncached_s += min(times["uncached"])
        res.bounded_s += min(times["bounded"])
        res.uncached_tokens += sum(r["prompt_tokens"] - r["cached_tokens"] for r in off["results"])
        res.computed_tokens += sum(r["prompt_tokens"] - r["cached_tokens"] for r in on["results"])
        res.ideal_tokens += ideal_computed_tokens(len(context), lens, ep.block_size)
        tokens, flops = reuse_costs(len(context), lens, TOKEN_COST), reuse_costs(len(context), lens, cost)
        res.bound_num, res.bound_den = res.bound_num + tokens[0], res.bound_den + tokens[1]
        res.flop_num, res.flop_den = res.flop_num + flops[0], res.flop_den + flops[1]
        res.max_abs_diff = max([res.max_abs_diff] + [abs(a - b) for x, y in zip(off["results"], on["results"])
                                                     for a, b in zip(x["logprobs"], y["logprobs"])])
    return res


def render(results: list[ShapeResult], console: Console, title: str) -> None:
    repeats = len(results[0].runs[0]["bounded"]) if results and results[0].runs else 0
    table = Table(title=f"OPD teacher scoring, K = 4, each group from an empty cache, best of {repeats} runs "
                        "per group and mode (real vLLM-CPU)")
    for col in ("shape", "groups", "uncached s", "bounded s", "speedup", "bound", "speedup/bound",
                "FLOP bound", "sp/FLOP bound", "median sp/bound", "computed tokens", "ideal", "uncached tokens",
                "max |dlogprob|"):
        table.add_column(col, justify="left" if col == "shape" else "right")
    for r in results:
        table.add_row(r.shape, str(r.groups), f"{r.uncached_s:.2f}", f"{r.bounded_s:.2f}", f"{r.speedup:.2f}x",
                      f"{r.bound:.2f}x", f"{r.speedup / r.bound:.3f}", f"{r.flop_bound:.2f}x",
                      f"{r.speedup / r.flop_bound:.3f}", f"{r.median_speedup / r.bound:.3f}",
                      f"{r.computed_tokens:,}",
                      f"{r.ideal_tokens:,}", f"{r.uncached_tokens:,}", f"{r.max_abs_diff:.3g}")
    console.print(table)
    console.print("speedup: each mode's best run per group; identical runs vary by several percent on a "
                  "shared machine, so a ratio above 1 is noise (more --repeats narrows it)")
    console.print(f"model: {title}; bound = K(P+R)/(P+KR) from token counts; FLOP bound weights each row by "
                  "its linear + attention FLOPs (cache_policy.scoring.PrefillCost)")


def model_cost(model_dir: str) -> tuple[PrefillCost, str]:
    """The prefill cost model of a served Llama folder, from its ``config.json``, and a label."""
    c = json.loads((Path(model_dir) / "config.json").read_text())
    cost = PrefillCost.llama(c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"],
                             c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"]),
                             c["vocab_size"], c.get("head_dim"))
    heads = f"{c['num_attention_heads']} x {c.get('head_dim') or c['hidden_size'] // c['num_attention_heads']}"
    label = (f"hidden {c['hidden_size']}, heads {heads}, MLP {c['intermediate_size']}, "
             f"{c['num_hidden_layers']} layers, "
             f"{cost.linear_flops / 1e6:.2f} MFLOP/row + {cost.attention_flops_per_key / 1e3:.1f} kFLOP/row/key")
    return cost, label


MODELS = {
    "teacher": "hidden 512, one 64-wide head, MLP 2048: attention takes the share of a prefill it "
               "takes in a 32B production teacher (TinyModelSpec.teacher_shaped)",
    "tiny": "the 128-wide test model: attention-bound, so the FLOP bound sits below the token bound",
    "wide": "Llama proportions at --width (TinyModelSpec.wide): 64-wide heads, MLP 2.75x",
}


def bench_model(name: str, width: int) -> str:
    """The served model for ``--model``: ``"tiny"`` (the replicas' default) or a generated folder."""
    if name == "tiny":
        return "tiny"
    spec = TinyModelSpec.teacher_shaped() if name == "teacher" else TinyModelSpec.wide(width)
    return str(ensure_tiny_model(spec=spec))


def isolate_worker_cores(cfg: ReplicaSetConfig) -> tuple[list[int], list[int]] | None:
    """Pin this process to the cores the replica's model worker is not bound to; return
    ``(worker cores, the others)``, or None (nothing pinned) when no core would be left over.

    vLLM-CPU binds the worker's OpenMP threads itself (``VLLM_CPU_OMP_THREADS_BIND``,
    :func:`replicas.server.omp_threads_bind`) and means the remaining cores for its front end
    and engine core (``vllm/utils/ompmultiprocessing.py`` reserves them). Everything started
    from here inherits this mask: Ray, the replica's API server and engine core (whose busy
    loop spins while the worker runs), and the two routers. Left floating, they land on the
    worker's core and slow forward passes by a varying amount, which is noise in the ratio.
    """
    available = sorted(os.sched_getaffinity(0))
    worker = parse_cpu_list(omp_threads_bind(cfg, 0))  # what replicas.server.build_env binds replica 0 to
    others = [c for c in available if c not in worker]
    if not others:
        return None
    os.sched_setaffinity(0, others)
    return worker, others


async def main_async(args: argparse.Namespace) -> list[ShapeResult]:
    console = Console(width=None if sys.stdout.isatty() else 240)  # logs keep the table's rows whole
    replicas = {"num_replicas": 1, "max_model_len": 8192, "model": bench_model(args.model, args.width),
                "max_num_batched_tokens": args.token_budget}
    cfg = AppConfig().replace(router={"port": 0, "scrape_interval_s": 0}, replicas=replicas)
    pinned = isolate_worker_cores(cfg.replicas) if args.isolate_worker else None
    if pinned:
        console.print(f"model worker on core(s) {pinned[0]}; routers, Ray and the replica's front end on {pinned[1]}")
    tokenizer = PromptTokenizer(tokenizer_path(cfg))
    cost, title = model_cost(resolve_model(cfg.replicas))
    title += f"; token budget {args.token_budget}"
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
            await _runs(http, urls, ep, warm_context, warm_responses, 2)  # one-time costs
            with Progress(*Progress.get_default_columns(), TimeElapsedColumn(), console=console,
                          transient=True) as progress:
                task = progress.add_task("scoring groups", total=len(args.shapes) * args.groups * args.repeats * 2)
                results = [await run_shape(http, urls, ep, SHAPE_KEYS[key], args.groups, tokenizer.vocab_size,
                                           args.seed + SHAPES.index(SHAPE_KEYS[key]), args.repeats, cost,
                                           lambda: progress.advance(task))
                           for key in args.shapes]
    render(results, console, title)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps([dict(dataclasses.asdict(r), speedup=r.speedup, bound=r.bound,
                                                   flop_bound=r.flop_bound, median_speedup=r.median_speedup,
                                                   model=title)
                                              for r in results], indent=2))
        console.print(f"wrote {args.out} (every run's wall time per group and mode under 'runs')")
    return results


positive_int = at_least(1)
"""argparse type: an integer >= 1 (``ArgumentTypeError`` naming the value otherwise)."""


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.scoring", description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=positive_int, default=4, help="groups per shape (default %(default)s)")
    parser.add_argument("--repeats", type=positive_int, default=7,
                        help="runs per group and mode, each from an empty cache; the fastest counts (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="random seed for the generated contexts and responses (default %(default)s)")
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPE_KEYS), default=["long", "short"],
                        help="workload shapes to run (default: both)")
    parser.add_argument("--model", choices=sorted(MODELS), default="teacher",
                        help="served model (default %(default)s): " + "; ".join(f"{k}: {v}" for k, v in MODELS.items()))
    parser.add_argument("--width", type=int, default=None, help="hidden size for --model wide (default 512)")
    parser.add_argument("--token-budget", type=positive_int, default=512,
                        help="the replica's max_num_batched_tokens: the most prompt tokens one engine step "
                             "prefills (default %(default)s, the budget of the OPD write-up's headline "
                             "measurement; vLLM-CPU's own default is 2048)")
    parser.add_argument("--isolate-worker", action=argparse.BooleanOptionalAction, default=True,
                        help="keep everything else off the replica worker's core(s) (default on)")
    parser.add_argument("--out", default="results/scoring.json")
    args = parser.parse_args()
    if args.width is not None and args.model != "wide":
        parser.error("--width applies to --model wide only")
    if args.model == "wide":
        args.width = args.width or 512
        try:
            TinyModelSpec.wide(args.width)
        except ValueError as exc:
            parser.error(f"--width: {exc}")
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
