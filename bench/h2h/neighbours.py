"""What busy polling costs the work beside the router: CPU-bound neighbours timed side by side.

``router.busy_poll_ms`` cuts the router-added latency (``bench.h2h.ab``: about 0.2-0.3 ms on new
4,000-token prompts here) by keeping the event loop running instead of sleeping between requests.
That CPU is not free when anything else on the machine wants it: this bench runs ``--neighbours``
CPU-bound processes (a fixed Python loop each; default one per CPU) while a client sends one
``--tokens``-token prompt at a time, pausing ``--gap-ms`` after each answer, through this checkout's router to a zero-cost simulated
replica (``bench.h2h.replicas_main --cost zero``), for each setting in turn, ``--rounds`` times
interleaved, and prints the neighbours' mean time over their time with no router at all, beside the
client's round trip through the router and replica (p50) and the router's CPU per request. Loopback only; every loop is bounded (the neighbours'
fixed work ends each run).

    .venv/bin/python -m bench.h2h.neighbours                     # busy_poll_ms 0 vs 50, 2 rounds
    .venv/bin/python -m bench.h2h.neighbours --poll-ms 0 5 50 --rounds 3

One run on this project's 2-vCPU VM (session 31, NOTES "Session 31"): two neighbours took 2.81 s
alone, 2.72 s beside a router not polling and 5.11 s beside a polling one (1.82x), whose requests
were no faster (p50 0.92 vs 0.97 ms: with both CPUs taken, polling buys little). A polling loop
that backed off at the first involuntary context switch (an experiment, not kept) left them unslowed but lost the whole
latency gain in ``bench.h2h.ab`` (there the other routers, the client and the replica are the
neighbours). So polling stays opt-in.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np
from rich.console import Console
from rich.table import Table

from bench.h2h.ab import _ready
from bench.h2h.cli import replica_process
from bench.h2h.drive import VOCAB_HI, VOCAB_LO
from bench.h2h.latency import cpu_s, pct
from bench.h2h.routers import ROOT, free_port

NEIGHBOUR = ("import time\nt = time.perf_counter()\nx = 0\nfor i in range({n}):\n    x += i\n"
             "print(time.perf_counter() - t)\n")
"""One neighbour: a fixed CPU-bound loop; prints its wall-clock seconds."""


async def _neighbours(count: int, loop_n: int) -> list[float]:
    """Run ``count`` neighbours at once; each one's wall-clock seconds."""
    procs = [await asyncio.create_subprocess_exec(sys.executable, "-c", NEIGHBOUR.format(n=loop_n),
                                                  stdout=subprocess.PIPE) for _ in range(count)]
    return [float((await p.communicate())[0]) for p in procs]


async def _one(setting: int | None, replica_url: str, body: bytes, args: argparse.Namespace, work: Path,
               http: aiohttp.ClientSession) -> dict[str, float]:
    """Neighbours beside the router with ``busy_poll_ms`` = ``setting`` (None: no router, no
    client): their mean seconds, and the router's requests, p50 ms and CPU ms per request."""
    if setting is None:
        return {"neighbour_s": float(np.mean(await _neighbours(args.neighbours, args.loop)))}
    port = free_port()
    config = work / f"router-{setting}.yaml"
    config.write_text(f"replicas:\n  urls: [{replica_url}]\nrouter:\n  busy_poll_ms: {setting}\n")
    log = work / f"router-{setting}.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "router", "serve", "--config", str(config), "--host", "127.0.0.1",
                                 "--port", str(port), "--log-level", "WARNING"], cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    url = f"http://127.0.0.1:{port}"
    try:
        await _ready(http, url, proc, f"router (busy_poll_ms {setting})", log)
        done = asyncio.Event()
        times: list[float] = []

        async def client() -> None:
            while not done.is_set():
                t = time.perf_counter()
                async with http.post(url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"}) as r:
                    await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"the router answered {r.status}")
                times.append(time.perf_counter() - t)
                await asyncio.sleep(args.gap_ms / 1e3)

        driver = asyncio.create_task(client())
        cpu0 = cpu_s(proc.pid)
        try:
            neighbour_s = float(np.mean(await _neighbours(args.neighbours, args.loop)))
        finally:
            done.set()
            await driver
        cpu = sum(b - a for a, b in zip(cpu0, cpu_s(proc.pid)))
        return {"neighbour_s": neighbour_s, "requests": len(times), "p50_ms": 1e3 * pct(times, 50),
                "cpu_ms_per_request": 1e3 * cpu / max(1, len(times))}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


async def run(args: argparse.Namespace) -> dict[str, list[dict[str, float]]]:
    """Every setting (and no router) ``args.rounds`` times, interleaved: ``{name: [result per round]}``."""
    from replicas.tiny_model.generate import ensure_tiny_model

    tokenizer = str(await asyncio.to_thread(ensure_tiny_model))
    work = Path(tempfile.mkdtemp(prefix="h2h-neighbours-"))
    rng = np.random.default_rng(args.seed)
    body = json.dumps({"model": "sim-model", "prompt": [int(x) for x in rng.integers(VOCAB_LO, VOCAB_HI, args.tokens)],
                       "max_tokens": 1}).encode()
    settings: list[int | None] = [None, *args.poll_ms]
    out: dict[str, list[dict[str, float]]] = {_name(s): [] for s in settings}
    async with replica_process(1, 4096, 16, "zero", tokenizer, work / "replica.log") as urls:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            for k in range(args.rounds):
                for s in settings:
                    r = await _one(s, urls[0], body, args, work, http)
                    out[_name(s)].append(r)
                    print(f"round {k + 1}/{args.rounds}: {_name(s)}: neighbours {r['neighbour_s']:.2f} s", flush=True)
    return out


def _name(setting: int | None) -> str:
    return "no router" if setting is None else f"busy_poll_ms {setting}"


def main(argv: list[str] | None = None) -> dict[str, list[dict[str, float]]]:
    p = argparse.ArgumentParser(prog="python -m bench.h2h.neighbours", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--poll-ms", type=int, nargs="+", default=[0, 50], help="router.busy_poll_ms settings (default 0 50)")
    p.add_argument("--neighbours", type=int, default=len(os.sched_getaffinity(0)),
                   help="CPU-bound neighbour processes (default: one per CPU)")
    p.add_argument("--loop", type=int, default=60_000_000, help="iterations of each neighbour's loop (default 6e7)")
    p.add_argument("--gap-ms", type=float, default=10.0, help="the client's pause after each answer (default 10)")
    p.add_argument("--tokens", type=int, default=4000, help="token IDs per prompt (default 4000)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if any(s < 0 for s in args.poll_ms) or args.neighbours < 1 or args.loop < 1 or args.gap_ms < 0 \
            or args.tokens < 1 or args.rounds < 1:
        p.error("--poll-ms >= 0, --neighbours, --loop, --tokens, --rounds >= 1, --gap-ms >= 0")
    try:
        result = asyncio.run(run(args))
    except RuntimeError as exc:
        p.exit(1, f"bench.h2h.neighbours: {exc}\n")
    alone = float(np.mean([r["neighbour_s"] for r in result["no router"]]))
    table = Table(title=f"{args.neighbours} CPU-bound neighbours beside a router serving {args.tokens}-token prompts "
                        f"one at a time, {args.gap_ms:g} ms apart ({args.rounds} rounds, means)")
    for col in ("router", "neighbours s", "vs no router", "round trip p50 ms", "router CPU ms / request"):
        table.add_column(col, justify="left" if col == "router" else "right")
    for name, rows in result.items():
        mean = float(np.mean([r["neighbour_s"] for r in rows]))
        router = [r for r in rows if "p50_ms" in r]
        table.add_row(name, f"{mean:.2f}", f"{mean / alone:.2f}x",
                      f"{np.mean([r['p50_ms'] for r in router]):.2f}" if router else "",
                      f"{np.mean([r['cpu_ms_per_request'] for r in router]):.2f}" if router else "")
    Console().print(table)
    return result


if __name__ == "__main__":
    main()
