"""Two checkouts of this router side by side: the same requests, interleaved, on one replica.

A change meant to make the router faster is measured against the commit before it in one run:
each checkout's ``rollout-router serve`` fronts the same zero-cost simulated replica
(``bench.h2h.replicas_main --cost zero``), next to five floors (:data:`FLOORS`): the aiohttp
pass-through (``bench.h2h.passthrough``), the same server posting through ours' replica client,
the bare-protocol floor under both (``bench.h2h.bare``: uvloop and httptools, no framework), and
that floor with the router's token-ID read, then also its decision core, on the critical path
(``bench.h2h.bare --split`` / ``--core``); every prompt (``--tokens`` random token IDs) goes directly and
through each router in turn, in a fresh random order each round, so the machine's drift hits all alike.
Prints per router the added latency (p50 and p99 of routed minus direct, ms) and its CPU per
request (user + system of its process, all threads, ms). A checkout is a folder with this
repository's code at some commit, e.g. ``git worktree add /tmp/before HEAD~1``. ``--rust``
adds Rust routers that take token-ID prompts (vllm-router's policies, from ``--rust-venv``) to the
same interleaving: the one comparison with them that the machine's drift does not skew (``python
-m bench.h2h --latency-only`` runs the routers one after another).

    python -m bench.h2h.ab /tmp/before .          # 1,000 requests each
    python -m bench.h2h.ab /tmp/before . --requests 2000 --tokens 4000
    python -m bench.h2h.ab . --rust "vllm-router round_robin" "vllm-router cache_aware"
    python -m bench.h2h.ab /tmp/before . --turns 8   # agent turns: prompts that extend a session's last

``--turns K`` (default 1: every prompt new, a prefix-cache miss) sends sessions of K turns instead,
each turn's prompt its session's previous one plus new tokens (the first ``3/4`` of ``--tokens``,
the last about ``--tokens``), with the session's routing-key header: from the second turn on, a
router that looks at prompts (ours' prefix index, a cache-aware policy) finds a long cached prefix,
the rollouts' common case.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from typing import Any

import aiohttp
import numpy as np
import yaml
from rich.console import Console
from rich.table import Table

from bench.h2h import profile
from bench.h2h.cli import replica_process
from bench.h2h.drive import VOCAB_HI, VOCAB_LO
from bench.h2h.latency import cpu_s, pct
from bench.h2h.routers import ALL, ROOT, RouterSpec, command, free_port, nested

OURS = next(s for s in ALL if s.kind == "ours")
"""The routing-key headers a checkout of this router reads (``--turns``)."""

READY_S = 120.0

FLOORS = {
    "passthrough": ("aiohttp pass-through", "bench.h2h.passthrough", []),
    "passthrough-lean": ("aiohttp server + lean client", "bench.h2h.passthrough", ["--client", "lean"]),
    "bare": ("bare uvloop + httptools pass-through", "bench.h2h.bare", []),
    "bare-split": ("bare + token-ID read", "bench.h2h.bare", ["--split"]),
    "bare-core": ("bare + token-ID read + decision core", "bench.h2h.bare", ["--core"]),
}
"""The pass-throughs measured beside the checkouts: row name, module, extra arguments. The second
is the aiohttp server with ours' replica client (``router.upstream``): it minus ``bare`` is what
the server framework costs. The last two add the router's own work to ``bare`` a piece at a time:
the token-ID read, then the decision core; ours minus ``bare-core`` is everything else (HTTP
semantics and validation, the lifecycle, the answer's annotation)."""


_RUST = [s for s in ALL if s.kind == "vllm"]
"""The Rust routers ``--rust`` may add: those whose ``/v1/completions`` takes token IDs."""


async def _ready(http: aiohttp.ClientSession, url: str, proc: subprocess.Popen, name: str,
                 log: Path | None = None) -> None:
    """Until ``url`` answers a one-block completion 200; RuntimeError if ``proc`` exits or time runs out."""
    body = {"model": "sim-model", "prompt": list(range(10, 30)), "max_tokens": 1}
    deadline = time.monotonic() + READY_S
    while True:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-3:] if log is not None else []
            raise RuntimeError(f"{name} exited with {proc.returncode}" + "".join(f"\n  {line}" for line in tail))
        try:
            async with http.post(url + "/v1/completions", json=body) as r:
                if r.status == 200:
                    return
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not route within {READY_S:g} s")
        await asyncio.sleep(0.25)


def turn_prompts(rng: np.random.Generator, tokens: int, turns: int):
    """Endless ``(session_id, token_ids)``: sessions of ``turns`` prompts, each extending the one
    before (``turns`` 1: a new session of ``tokens`` IDs every time)."""
    first = tokens if turns == 1 else tokens * 3 // 4
    step = 0 if turns == 1 else (tokens - first) // (turns - 1)
    for session in itertools.count():
        ids = rng.integers(VOCAB_LO, VOCAB_HI, first).tolist()
        for turn in range(turns):
            if turn:
                ids = ids + rng.integers(VOCAB_LO, VOCAB_HI, step).tolist()
            yield f"ab-{session}", ids


OWN_SETTINGS = ("router.host", "router.port", "replicas.urls")
"""Settings ``ab`` gives every checkout's router itself (its port, the replica it measures)."""


def checkout(arg: str) -> Path | tuple[Path, dict[str, Any]]:
    """A ``checkouts`` argument: ``PATH`` or ``PATH@key=value,key=value`` (dotted config keys,
    YAML values: ``.@router.busy_poll_ms=50``): that checkout's router runs with those settings;
    the key ``python`` (no section) names the interpreter it runs on instead of ab's own
    (``.@python=/tmp/venv-other/bin/python``: two builds of CPython side by side).
    The settings start at the last ``@`` followed by an ``=`` somewhere (a path may hold ``@``).
    ArgumentTypeError for a setting that is not ``section.key=value``, a value that is not YAML,
    or one of :data:`OWN_SETTINGS`."""
    path, at, rest = arg.rpartition("@")
    if not at or "=" not in rest:
        return Path(arg)
    settings: dict[str, Any] = {}
    for item in rest.split(","):
        key, eq, value = item.partition("=")
        if key == "python":
            if not (eq and os.access(value, os.X_OK) and Path(value).is_file()):
                raise argparse.ArgumentTypeError(f"{arg!r}: python={value!r} is not an executable file")
            settings[key] = value
            continue
        if not eq or key.count(".") != 1 or not all(key.split(".")):
            raise argparse.ArgumentTypeError(f"{arg!r}: settings are section.key=value, got {item!r}")
        if key in OWN_SETTINGS:
            raise argparse.ArgumentTypeError(f"{arg!r}: {key} is set by ab itself (every router measures the same replica)")
        try:
            settings[key] = yaml.safe_load(value)
        except yaml.YAMLError as exc:
            raise argparse.ArgumentTypeError(f"{arg!r}: the value of {key} is not YAML: {' '.join(str(exc).split())}") from None
    return Path(path), settings


def build_native(root: Path, python: str = sys.executable) -> None:
    """Build ``root``'s C extension in place (as ``scripts/setup.sh`` does; setuptools skips it when
    it is up to date) and check that its router would load it: a fresh ``git worktree`` has none,
    and a checkout running the pure-Python fallbacks measured ~1 ms slower than the same commit
    built. RuntimeError naming the checkout when either fails."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    steps = ([python, "setup.py", "-q", "build_ext", "--inplace"],
             [python, "-c", "import sys; from cache_policy.native import NATIVE; sys.exit(NATIVE is None)"])
    for argv in steps:
        done = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"{root}: {' '.join(argv[1:3])} failed (the C extension): "
                               f"{(done.stderr or done.stdout).strip()[-500:]}")


async def run(checkouts: list[Path | tuple[Path, dict[str, Any]]], requests: int, tokens: int, seed: int, warmup: int = 50,
              spy_venv: Path | None = None, rust: list[RouterSpec] = (), rust_venv: Path | None = None,
              turns: int = 1) -> dict[str, dict]:
    """Added latency and CPU per request of each checkout's router and of the floor; with ``spy_venv``
    (a venv holding py-spy), the last checkout's router is sampled during the timed requests and its
    result holds ``profile`` (``bench.h2h.profile.top_frames``)."""
    from replicas.tiny_model.generate import ensure_tiny_model

    tokenizer = str(await asyncio.to_thread(ensure_tiny_model))
    for root, python in dict.fromkeys((c[0], c[1].get("python", sys.executable)) if isinstance(c, tuple)
                                      else (c, sys.executable) for c in checkouts):
        await asyncio.to_thread(build_native, root, python)
    work = Path(tempfile.mkdtemp(prefix="h2h-ab-"))
    try:
        out = await _run(checkouts, requests, tokens, seed, warmup, spy_venv, rust, rust_venv, turns, tokenizer, work)
    except BaseException:
        print(f"bench.h2h.ab: the routers' logs are in {work}", file=sys.stderr)
        raise
    shutil.rmtree(work, ignore_errors=True)
    return out


async def _run(checkouts, requests, tokens, seed, warmup, spy_venv, rust, rust_venv, turns, tokenizer: str,
               work: Path) -> dict[str, dict]:
    async with replica_process(1, 4096, 16, "zero", tokenizer, work / "replica.log") as urls:
        config = work / "router.yaml"
        config.write_text(f"replicas:\n  urls: [{urls[0]}]\n")
        procs: dict[str, tuple[subprocess.Popen, str]] = {}
        logs: dict[str, Path] = {}
        specs: dict[str, RouterSpec] = {}  # the routers that take a routing key (with --turns)
        try:
            for k, root in enumerate([*checkouts, *FLOORS, *rust]):
                port = free_port()
                if isinstance(root, RouterSpec):
                    name, cwd = root.name, ROOT
                    specs[name] = root
                    argv = command(root, urls[:1], port, rust_venv or ROOT / ".venv-h2h", work)
                elif isinstance(root, str):  # a floor
                    name, cwd = FLOORS[root][0], ROOT
                    argv = [sys.executable, "-m", FLOORS[root][1], "--port", str(port), urls[0], *FLOORS[root][2]]
                else:
                    root, settings = root if isinstance(root, tuple) else (root, {})
                    name, cwd = f"{k + 1}: {root}" + "".join(f" {key}={v}" for key, v in settings.items()), root
                    settings = dict(settings)
                    python = settings.pop("python", sys.executable)
                    specs[name], last_ours = OURS, name
                    own = config
                    if settings:
                        own = work / f"router-{k}.yaml"
                        own.write_text(yaml.safe_dump(nested([("replicas.urls", [urls[0]]), *settings.items()])))
                    argv = [python, "-m", "router", "serve", "--config", str(own), "--host", "127.0.0.1",
                            "--port", str(port), "--log-level", "WARNING"]
                logs[name] = work / f"router-{k}.log"
                with open(logs[name], "ab") as log:
                    procs[name] = (subprocess.Popen(argv, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                                    start_new_session=True, env={**os.environ, "PYTHONPATH": str(cwd)}),
                                   f"http://127.0.0.1:{port}")
            prompts = turn_prompts(np.random.default_rng(seed), tokens, turns)
            order_rng = np.random.default_rng(seed + 1)
            times: dict[str, list[float]] = {name: [] for name in ["direct", *procs]}
            targets = [("direct", urls[0]), *((name, url) for name, (_, url) in procs.items())]
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
                for name, (proc, url) in procs.items():
                    await _ready(http, url, proc, name, logs[name])
                cpu0: dict[str, tuple[float, float]] = {}
                spy = None
                for i in range(-warmup, requests):
                    if i == 0:
                        cpu0 = {name: cpu_s(proc.pid) for name, (proc, _) in procs.items()}
                        if spy_venv is not None:
                            spy = profile.start(procs[last_ours][0].pid, work, spy_venv)
                    session, ids = next(prompts)
                    body = json.dumps({"model": "sim-model", "prompt": ids, "max_tokens": 1}).encode()
                    # a fresh order each round: with a rotation, the router after ``direct`` was always
                    # the same one, and it read ~0.2 ms slower than an identical copy of itself
                    for t in order_rng.permutation(len(targets)):
                        name, url = targets[t]
                        started = time.perf_counter()
                        key = specs[name].headers(session, None) if turns > 1 and name in specs else {}
                        async with http.post(url + "/v1/completions", data=body,
                                             headers={"Content-Type": "application/json", **key}) as r:
                            await r.read()
                            if r.status != 200:
                                raise RuntimeError(f"{name} answered {r.status}")
                        if i >= 0:
                            times[name].append(time.perf_counter() - started)
            out: dict[str, dict] = {}
            if spy is not None:
                out["profile"] = profile.stop(spy, top=25)
            for name, (proc, _) in procs.items():
                user, system = (b - a for a, b in zip(cpu0[name], cpu_s(proc.pid)))
                out[name] = {"added_p50_ms": 1e3 * (pct(times[name], 50) - pct(times["direct"], 50)),
                             "added_p99_ms": 1e3 * (pct(times[name], 99) - pct(times["direct"], 99)),
                             "cpu_ms_per_request": 1e3 * (user + system) / requests,
                             "direct_p50_ms": 1e3 * pct(times["direct"], 50)}
            return out
        finally:
            for proc, _ in procs.values():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc, _ in procs.values():
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)


def main(argv: list[str] | None = None) -> dict[str, dict]:
    p = argparse.ArgumentParser(prog="python -m bench.h2h.ab", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkouts", nargs="+", type=checkout,
                   help="folders holding this repository at the commits to compare; PATH@section.key=value,... "
                        "runs that checkout's router with those settings (e.g. .@router.busy_poll_ms=50); "
                        "PATH@python=INTERPRETER runs it on another Python build")
    p.add_argument("--requests", type=int, default=1000, help="timed requests per router (default 1000)")
    p.add_argument("--tokens", type=int, default=4000, help="token IDs per prompt (default 4000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--turns", type=int, default=1,
                   help="turns per session: each prompt extends the one before (default 1: every prompt new)")
    p.add_argument("--py-spy", type=Path, default=None, metavar="VENV",
                   help="sample the last checkout's router with VENV/bin/py-spy; prints its top frames")
    p.add_argument("--rust", nargs="+", default=[], metavar="ROUTER",
                   help="Rust routers to interleave too, by name (taking token-ID prompts): "
                        + ", ".join(repr(s.name) for s in _RUST))
    p.add_argument("--rust-venv", type=Path, default=ROOT / ".venv-h2h", help="the venv holding vllm-router")
    args = p.parse_args(argv)
    by_name = {s.name: s for s in _RUST}
    for name in args.rust:
        if name not in by_name:
            p.error(f"--rust {name!r}: one of {', '.join(by_name)}")
    if args.turns < 1 or args.tokens < 4 * args.turns:
        p.error("--turns must be >= 1 and --tokens at least 4x --turns")
    if args.requests < 1 or args.seed < 0:
        p.error("--requests must be >= 1 and --seed >= 0")
    for c in args.checkouts:
        path = c[0] if isinstance(c, tuple) else c
        if not (path / "router" / "__main__.py").is_file():
            p.error(f"{path} does not hold this repository (no router/__main__.py)")
    checkouts = [(c[0].resolve(), c[1]) if isinstance(c, tuple) else c.resolve() for c in args.checkouts]
    try:
        result = asyncio.run(run(checkouts, args.requests, args.tokens, args.seed,
                                 spy_venv=args.py_spy.resolve() if args.py_spy else None,
                                 rust=[by_name[n] for n in args.rust], rust_venv=args.rust_venv.resolve(),
                                 turns=args.turns))
    except RuntimeError as exc:  # a router that would not start, a checkout without its extension
        p.exit(1, f"bench.h2h.ab: {exc}\n")
    spied = result.pop("profile", None)
    what = f"{args.tokens}-token prompts" if args.turns == 1 else f"agent turns ({args.turns} per session, up to {args.tokens} tokens)"
    table = Table(title=f"Router-added latency, {args.requests} interleaved {what}, one replica "
                        f"(direct p50 {next(iter(result.values()))['direct_p50_ms']:.2f} ms)")
    for col in ("router", "added p50 ms", "added p99 ms", "CPU ms / request"):
        table.add_column(col, justify="right" if col != "router" else "left")
    for name, r in result.items():
        table.add_row(name, f"{r['added_p50_ms']:+.2f}", f"{r['added_p99_ms']:+.2f}", f"{r['cpu_ms_per_request']:.2f}")
    Console().print(table)
    if spied is not None:
        if "error" in spied:
            print("py-spy:", spied["error"])
        else:
            print(f"py-spy, {spied['samples']} samples of the last router (self share / total share):")
            for (frame, own), (tframe, tot) in zip(spied["self"], spied["total"]):
                print(f"  self {own:6.1%}  {frame[:90]:90s}  total {tot:6.1%}  {tframe[:90]}")
    return result


if __name__ == "__main__":
    main()
