"""What one routing decision costs the router, as a function of the fleet size N.

Drives ``cache_policy.core.DecisionCore`` alone (no HTTP, no engine) through the whole lifecycle of
each request — open (salt + block hashes), place, admit, finish, pump — on a fixed workload of
sessions and GRPO groups with 2,000-token prompts, and prints microseconds per request for each N
side by side with the N = 4 figure and the per-replica scan cost ((cost(N) - cost(4)) / (N - 4)).

    python -m bench.decision_cost                 # N = 4, 64, 1024; 5,000 requests each
    python -m bench.decision_cost --replicas 4,256,4096 --requests 2000
"""

from __future__ import annotations

import argparse
import random
import time

from rich.console import Console
from rich.table import Table

from cache_policy.config import PolicyConfig
from cache_policy.core import DecisionCore, RequestSpec


def cost_per_request(n: int, requests: int, prompt_tokens: int, seed: int) -> float:
    """Median-free, plain mean: microseconds of core time per request on an ``n``-replica fleet."""
    core = DecisionCore(PolicyConfig())
    for i in range(n):
        core.add_replica(f"replica-{i}", block_size=32, num_gpu_blocks=100_000)
    rng = random.Random(seed)
    prompts = [list(range(k * 100_000, k * 100_000 + prompt_tokens)) for k in range(256)]
    running = []
    started = time.perf_counter()
    for i in range(requests):
        now = i * 1e-3
        key = rng.randrange(1024)
        spec = (RequestSpec(prompts[key % 256], session_id=f"s{key}", new_tokens=64) if i % 2 else
                RequestSpec(prompts[key % 256], group_id=f"g{key % 64}", new_tokens=64))
        job = core.open(spec, now)
        core.place(job, now)
        core.admit(job, now)
        running.append(job)
        if len(running) > 64:
            core.finish(running.pop(0), "ok", now)
        core.pump(now)
    return (time.perf_counter() - started) / requests * 1e6


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="bench.decision_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", default="4,64,1024", help="fleet sizes N, comma-separated (default 4,64,1024)")
    p.add_argument("--requests", type=int, default=5000, help="requests per fleet size (default 5000)")
    p.add_argument("--prompt-tokens", type=int, default=2000, help="tokens per prompt (default 2000)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    args = p.parse_args(argv)
    sizes = sorted({int(x) for x in args.replicas.split(",")})
    costs = {n: cost_per_request(n, args.requests, args.prompt_tokens, args.seed) for n in sizes}
    base_n = sizes[0]
    table = Table(title=f"Decision cost per request (open+place+admit+finish+pump), {args.requests} requests, "
                        f"{args.prompt_tokens}-token prompts")
    for col in ("replicas N", "us / request", f"x N={base_n}", "us per extra replica scanned"):
        table.add_column(col, justify="right")
    for n in sizes:
        extra = (costs[n] - costs[base_n]) / (n - base_n) if n > base_n else 0.0
        table.add_row(str(n), f"{costs[n]:.1f}", f"{costs[n] / costs[base_n]:.2f}", f"{extra:.3f}")
    Console().print(table)


if __name__ == "__main__":
    main()
