"""The decision core's cost in CPU instructions per request, checkouts side by side: deterministic
where timings on a shared VM are not.

Runs ``bench.decision_cost``'s workload (sessions and GRPO groups of 2,000-token prompts; open,
place, admit, pump and finish per request) in each checkout under valgrind's ``callgrind`` twice,
with ``--short`` and ``--long`` requests, and prints ``(instructions(long) - instructions(short)) /
(long - short)``: the interpreter's start-up and the fleet's set-up cancel out. ``PYTHONHASHSEED=0``
makes the string hashing, and so the dict layouts, the same in every run. On this machine
``bench.decision_cost`` read 1,154 to 1,968 us for the same code within minutes; these counts repeat
to within a few instructions. An instruction is not a microsecond (a cache miss costs hundreds), so
judge a change by both. Needs ``valgrind`` (``apt-get install valgrind``); each count takes
30-90 s (callgrind runs Python ~50x slower).

    python -m bench.instructions /tmp/before .                  # N = 4, 64, 1024
    python -m bench.instructions . --replicas 1024 --short 50 --long 150
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rich.console import Console
from rich.table import Table

_COLLECTED = re.compile(rb"Collected : (\d+)")

_WORKLOAD = "import sys; from bench.decision_cost import cost_per_request; cost_per_request(*map(int, sys.argv[1:]))"
"""The timed loop of ``bench.decision_cost`` (its two clock reads are the same in both runs)."""


def valgrind_command(replicas: int, requests: int, prompt_tokens: int, seed: int) -> list[str]:
    """The argv that counts the instructions of ``requests`` requests on ``replicas`` replicas (run
    with the checkout's folder first on ``PYTHONPATH``: :func:`count`)."""
    return ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, "-c", _WORKLOAD,
            str(replicas), str(requests), str(prompt_tokens), str(seed)]


def collected(stderr: bytes) -> int:
    """The instruction count callgrind prints at exit (``==pid== Collected : N``); ValueError if absent."""
    found = _COLLECTED.search(stderr)
    if found is None:
        raise ValueError(f"no instruction count in valgrind's output: {stderr[-500:].decode(errors='replace')}")
    return int(found.group(1))


def count(checkout: Path, replicas: int, requests: int, prompt_tokens: int, seed: int) -> int:
    """Instructions of one run of the workload in ``checkout`` (its own ``cache_policy``)."""
    env = {**os.environ, "PYTHONPATH": str(checkout.resolve()), "PYTHONHASHSEED": "0"}
    done = subprocess.run(valgrind_command(replicas, requests, prompt_tokens, seed), cwd=checkout,
                          env=env, capture_output=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{checkout}: the workload failed: {done.stderr[-800:].decode(errors='replace')}")
    return collected(done.stderr)


def per_request(checkout: Path, replicas: int, short: int, long: int, prompt_tokens: int, seed: int) -> float:
    """Instructions per request: the difference of a ``long`` and a ``short`` run over their
    difference in requests (start-up and set-up cancel)."""
    a = count(checkout, replicas, short, prompt_tokens, seed)
    b = count(checkout, replicas, long, prompt_tokens, seed)
    return (b - a) / (long - short)


def main(argv: list[str] | None = None) -> dict[str, dict[int, float]]:
    p = argparse.ArgumentParser(prog="python -m bench.instructions", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkouts", nargs="+", type=Path, help="folders holding this repository (git worktrees)")
    p.add_argument("--replicas", default="4,64,1024", help="fleet sizes N, comma-separated (default 4,64,1024)")
    p.add_argument("--short", type=int, default=50, help="requests of the short run (default 50)")
    p.add_argument("--long", type=int, default=150, help="requests of the long run (default 150)")
    p.add_argument("--prompt-tokens", type=int, default=2000, help="tokens per prompt (default 2000)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    args = p.parse_args(argv)
    if args.long <= args.short or args.short < 1:
        p.error("--long must be more than --short, and --short at least 1")
    if shutil.which("valgrind") is None:
        p.error("valgrind is not installed (apt-get install valgrind)")
    for checkout in args.checkouts:
        if not (checkout / "cache_policy" / "core.py").is_file():
            p.error(f"{checkout} holds no checkout of this repository (no cache_policy/core.py)")
    sizes = sorted({int(x) for x in args.replicas.split(",")})
    jobs = [(c, n) for n in sizes for c in args.checkouts]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # one valgrind per core
        counts = list(pool.map(lambda job: per_request(job[0], job[1], args.short, args.long, args.prompt_tokens,
                                                       args.seed), jobs))
    out: dict[str, dict[int, float]] = {}
    for (checkout, n), value in zip(jobs, counts):
        out.setdefault(str(checkout), {})[n] = value
    table = Table(title=f"Decision-core instructions per request (callgrind; {args.long} - {args.short} requests, "
                        f"{args.prompt_tokens}-token prompts)")
    table.add_column("replicas N", justify="right")
    for checkout in args.checkouts:
        table.add_column(str(checkout), justify="right")
    if len(args.checkouts) > 1:
        table.add_column("last / first", justify="right")
    for n in sizes:
        row = [out[str(c)][n] for c in args.checkouts]
        cells = [f"{v / 1e3:,.0f}K" for v in row] + ([f"{row[-1] / row[0]:.2f}"] if len(row) > 1 else [])
        table.add_row(str(n), *cells)
    Console().print(table)
    return out


if __name__ == "__main__":
    main()
