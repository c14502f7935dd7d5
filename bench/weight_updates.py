"""Weight updates at RL cadence: what each pause mode and policy costs under a steady mixed load.

Two replicas (the tiny model), one router per case. For each pause mode x policy: the replicas
go back to the seed-0 checkpoint with an empty cache, a steady load runs (agent sessions of
growing non-streamed turns, GRPO groups of streamed samples, scoring fan-outs, ``--workers``
loops) and ``--updates`` folder updates (versions 1..K, alternating the seed-1 and seed-0
checkpoints) are made every ``--interval`` seconds through ``POST /admin/weights``. Printed per case:

* aborted: answers that ended with ``finish_reason: "abort"`` or failed (non-200)
* re-run: times a request was taken back by an update and run again (``reruns`` in its answer)
* mixed tokens: generated tokens of answers computed by more than one version (``weight_versions``);
  hybrid tokens: those computed by one version's weights over another's KV (``spans[].hybrid``)
* paused s/update: fleet time paused per update (sum over replicas of ``/pause`` to ``/resume``)
* prefill after/before: prompt tokens prefilled (prompt - cached, from each answer's usage) in the
  ``--window`` seconds after each update vs the same window before it

    flock /tmp/vllm.lock .venv/bin/python -m bench.weight_updates
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field

import aiohttp

from replicas.config import ReplicaSetConfig
from replicas.replica_set import ReplicaSet
from replicas.tiny_model import TinyModelSpec, ensure_tiny_model
from replicas.weights import update_weights
from router.config import AppConfig
from router.server import running_router

TOKEN = "bench-admin-token"
POLICIES = ("flush", "keep", "salt", "keep+salt")
PAUSE_MODES = ("wait", "keep", "abort")


@dataclass
class Tally:
    """One case's counts; ``prefill``: (start time, prompt tokens prefilled) per answer."""

    answers: int = 0
    aborted: int = 0
    reruns: int = 0
    mixed_tokens: int = 0
    hybrid_tokens: int = 0
    tokens: int = 0
    paused_s: list[float] = field(default_factory=list)
    updates: list[tuple[float, float]] = field(default_factory=list)
    prefill: list[tuple[float, int]] = field(default_factory=list)

    def answer(self, started: float, note: dict | None, usage: dict | None, generated: int, finish: str | None) -> None:
        self.answers += 1
        self.aborted += finish == "abort"
        if usage:
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            self.prefill.append((started, usage.get("prompt_tokens", 0) - cached))
        if note is None:
            return
        self.reruns += note.get("reruns", 0)
        self.tokens += generated
        if len(note.get("weight_versions", [])) > 1:
            self.mixed_tokens += generated
        spans = note.get("spans") or []
        bounds = [int((s.get("from_token") or {}).get("0", 0)) for s in spans] + [generated]
        self.hybrid_tokens += sum(b - a for s, a, b in zip(spans, bounds, bounds[1:]) if s.get("hybrid"))

    def prefill_ratio(self, window: float) -> float | None:
        before = sum(n for t, n in self.prefill for s, _ in self.updates if s - window <= t < s)
        after = sum(n for t, n in self.prefill for _, e in self.updates if e <= t < e + window)
        return after / before if before else None


async def _post(http, url: str, body: dict, headers: dict) -> tuple[int, dict]:
    async with http.post(url, json=body, headers=headers) as r:
        return r.status, await r.json()


async def _session(http, url, rng, tally: Tally, stop: asyncio.Event, k: int) -> None:
    history, n = [rng.randrange(8, 1000) for _ in range(300)], 0
    while not stop.is_set():
        started = time.monotonic()
        body = {"prompt": history, "max_tokens": 24, "ignore_eos": True, "return_token_ids": True}
        status, answer = await _post(http, url + "/v1/completions", body, {"X-Session-Id": f"s{k}-{n}"})
        if status != 200:
            tally.aborted += 1
            continue
        choice = answer["choices"][0]
        tally.answer(started, answer.get("rollout_router"), answer.get("usage"), len(choice["token_ids"]),
                     choice.get("finish_reason"))
        history = history + choice["token_ids"] + [rng.randrange(8, 1000) for _ in range(60)]
        if len(history) > 1500:  # the rollout ends; the next one starts
            history, n = [rng.randrange(8, 1000) for _ in range(300)], n + 1


async def _group(http, url, rng, tally: Tally, stop: asyncio.Event, k: int) -> None:
    g = 0
    while not stop.is_set():
        prompt = [rng.randrange(8, 1000) for _ in range(400)]
        g += 1
        await asyncio.gather(*(_stream(http, url, prompt, f"g{k}-{g}", tally) for _ in range(4)))


async def _stream(http, url, prompt, group, tally: Tally) -> None:
    started = time.monotonic()
    body = {"prompt": prompt, "max_tokens": 96, "ignore_eos": True, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    async with http.post(url + "/v1/completions", json=body, headers={"X-Group-Id": group}) as r:
        if r.status != 200:
            tally.aborted += 1
            return
        note, usage, generated, finish = None, None, 0, None
        async for line in r.content:
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            event = json.loads(line[5:])
            for choice in event.get("choices") or []:
                generated += len(choice.get("token_ids") or [])
                finish = choice.get("finish_reason") or finish
            usage = event.get("usage") or usage
            note = event.get("rollout_router") or note
    tally.answer(started, note, usage, generated, finish)


async def _scoring(http, url, rng, tally: Tally, stop: asyncio.Event, k: int) -> None:
    while not stop.is_set():
        started = time.monotonic()
        body = {"context": [rng.randrange(8, 1000) for _ in range(300)],
                "responses": [[rng.randrange(8, 1000) for _ in range(40)] for _ in range(4)]}
        status, answer = await _post(http, url + "/v1/score", body, {})
        if status != 200:
            tally.aborted += 1
            continue
        tally.answers += 1
        tally.reruns += answer.get("reruns", 0)
        tally.prefill.append((started, sum(r["prompt_tokens"] - r["cached_tokens"] for r in answer["results"])))


async def run_case(rs: ReplicaSet, http, ckpt: dict[int, str], policy: str, pause_mode: str,
                   args: argparse.Namespace) -> Tally:
    for ep in rs.endpoints:
        assert (await update_weights(http, ep.base_url, ckpt[0], reset_prefix_cache=True)).ok
    cfg = AppConfig(replicas=rs.cfg).replace(router={"port": 0, "scrape_interval_s": 0.2, "admin_token": TOKEN,
                                                     "weight_update_policy": policy, "initial_weights_path": ckpt[0]})
    tally, stop, rng = Tally(), asyncio.Event(), random.Random(7)
    async with running_router(cfg, rs.endpoints) as (url, _):
        loops = [asyncio.ensure_future(f(http, url, random.Random(rng.random()), tally, stop, k))
                 for k in range(args.workers) for f in (_session, _group, _scoring)]
        for version in range(1, args.updates + 1):
            await asyncio.sleep(args.interval)
            body = {"version": version, "weights_path": ckpt[version % 2], "policy": policy, "pause_mode": pause_mode,
                    "mode": args.mode}
            started = time.monotonic()
            _, report = await _post(http, url + "/admin/weights", body, {"Authorization": f"Bearer {TOKEN}"})
            tally.updates.append((started, time.monotonic()))
            tally.paused_s.append(report["paused_s"])
        await asyncio.sleep(args.window)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*loops), 300)
    return tally


def render(rows: list[tuple[str, str, Tally]], window: float) -> str:
    head = (f"{'pause':6} {'policy':10} {'answers':>7} {'aborted':>7} {'re-run':>6} {'mixed tok':>9} "
            f"{'hybrid tok':>10} {'of tok':>7} {'paused s/upd':>12} {'prefill after/before':>20}")
    lines = [head, "-" * len(head)]
    for pause, policy, t in rows:
        ratio = t.prefill_ratio(window)
        paused = sum(t.paused_s) / max(1, len(t.paused_s))
        lines.append(f"{pause:6} {policy:10} {t.answers:7d} {t.aborted:7d} {t.reruns:6d} {t.mixed_tokens:9d} "
                     f"{t.hybrid_tokens:10d} {t.tokens:7d} {paused:12.3f} "
                     f"{'n/a' if ratio is None else f'{ratio:.2f}':>20}")
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> None:
    ckpt = {i: str(ensure_tiny_model(spec=TinyModelSpec(seed=i))) for i in (0, 1)}
    replicas = ReplicaSetConfig(num_replicas=args.replicas, max_model_len=2048, enable_plugin=False)
    async with ReplicaSet(replicas) as rs:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900), middlewares=(rs.auth,)) as http:
            rows = [(pause, policy, await run_case(rs, http, ckpt, policy, pause, args))
                    for pause in args.pause_modes for policy in args.policies]
    print(f"{args.updates} updates every {args.interval} s ({args.mode}), {args.replicas} replicas, "
          f"{args.workers} x (session, group of 4 streams, scoring K=4) loops; prefill window {args.window} s")
    print(render(rows, args.window))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.weight_updates", description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=3, help="updates per case (K)")
    parser.add_argument("--interval", type=float, default=4.0, help="seconds of load before each update")
    parser.add_argument("--window", type=float, default=2.0, help="prefill window before/after each update (s)")
    parser.add_argument("--workers", type=int, default=1, help="loops of each kind")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--mode", choices=("rolling", "all"), default="rolling")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--pause-modes", nargs="+", default=list(PAUSE_MODES), choices=PAUSE_MODES)
    asyncio.run(main_async(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
