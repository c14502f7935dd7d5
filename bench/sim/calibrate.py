"""Fit ``bench.sim.cost.CostModel`` to one real vLLM-CPU replica on this machine.

    flock /tmp/vllm.lock .venv/bin/python -m bench.sim.calibrate

Starts ONE replica of the tiny model (``replicas.replica_set.ReplicaSet``), sends fresh random
token-ID prompts (no prefix hits) in a handful of shapes (prefill of 256..4096 tokens; decode of
1..16 concurrent sequences), and times each request end to end. The engine model replays the same
shapes with unit coefficients, which gives each shape's step count, sequence-steps, tokens and
attention pairs; a non-negative least-squares fit of the measured latencies on those features (plus
a per-request HTTP overhead that is not part of the engine) gives the coefficients. It prints them,
each shape measured vs predicted, and the mean absolute error.
"""

from __future__ import annotations

import asyncio
import random
import time

import aiohttp
import numpy as np

from bench.sim.cost import CostModel
from bench.sim.engine import Engine, EngineConfig, SimRequest

BUDGET = 2048
BLOCK = 32
SHAPES = [  # (concurrent requests, prompt tokens, max_tokens)
    (1, 256, 1), (1, 1024, 1), (1, 2048, 1), (1, 4096, 1), (1, 3000, 1),
    (1, 64, 64), (4, 64, 64), (16, 64, 64), (8, 512, 32), (1, 2048, 32),
]
UNITS = {"step": CostModel(1, 0, 0, 0), "seq": CostModel(0, 1, 0, 0),
         "token": CostModel(0, 0, 1, 0), "key": CostModel(0, 0, 0, 1)}


def features(shape: tuple[int, int, int]) -> list[float]:
    """Per-request mean latency of ``shape`` under each unit cost model (the fit's regressors)."""
    n, prompt, out = shape
    row = []
    for unit in UNITS.values():
        e = Engine("cal", EngineConfig(num_blocks=4096, block_size=BLOCK, max_num_batched_tokens=BUDGET, cost=unit))
        reqs = [SimRequest(str(i), tuple(range(i * 1000, i * 1000 + prompt // BLOCK)), prompt, out) for i in range(n)]
        for r in reqs:
            e.submit(r, 0.0)
        while e.wake_at is not None:
            e.wake(e.wake_at)
        row.append(sum(r.finish_s for r in reqs) / n)
    return row + [1.0]  # the HTTP + front-end overhead per request


async def measure(url: str, shape: tuple[int, int, int], vocab: int, rng: random.Random, repeats: int) -> float:
    n, prompt, out = shape
    times = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        for _ in range(repeats):
            async def one() -> float:
                ids = [rng.randrange(8, vocab) for _ in range(prompt)]
                body = {"model": "tiny-llama", "prompt": ids, "max_tokens": out, "min_tokens": out,
                        "temperature": 0.0, "ignore_eos": True}
                t0 = time.perf_counter()
                async with http.post(f"{url}/v1/completions", json=body) as resp:
                    resp.raise_for_status()
                    await resp.read()
                return time.perf_counter() - t0
            times.append(float(np.mean(await asyncio.gather(*(one() for _ in range(n))))))
    return float(np.median(times))


def fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares on relative error (each row scaled by 1 / measured)."""
    w = 1.0 / y
    a, b = x * w[:, None], y * w
    keep = list(range(x.shape[1]))
    while True:  # drop a column whose coefficient comes out negative, refit (small active-set NNLS)
        sol, *_ = np.linalg.lstsq(a[:, keep], b, rcond=None)
        if (sol >= 0).all():
            break
        keep.pop(int(np.argmin(sol)))
    coef = np.zeros(x.shape[1])
    coef[keep] = sol
    return coef


async def main_async(repeats: int = 3) -> None:
    from replicas.config import ReplicaSetConfig
    from replicas.replica_set import ReplicaSet

    cfg = ReplicaSetConfig(num_replicas=1, block_size=BLOCK, max_num_batched_tokens=BUDGET, max_model_len=8192)
    async with ReplicaSet(cfg) as rs:
        url = rs.endpoints[0].base_url
        vocab = 1000  # the tiny model's vocabulary is larger; ordinary ids start at 8
        async with aiohttp.ClientSession() as http, http.get(f"{url}/v1/models") as r:
            await r.read()
        rng = random.Random(0)
        await measure(url, (1, 512, 8), vocab, rng, 2)  # warm-up
        ys = [await measure(url, s, vocab, rng, repeats) for s in SHAPES]
    x = np.array([features(s) for s in SHAPES])
    y = np.array(ys)
    coef = fit(x, y)
    pred = x @ coef
    print(f"CostModel(step={coef[0]:.3e}, seq={coef[1]:.3e}, token={coef[2]:.3e}, key={coef[3]:.3e}); "
          f"HTTP overhead per request {coef[4] * 1e3:.2f} ms")
    for s, m, p in zip(SHAPES, y, pred):
        print(f"  {s[0]:>2} x prompt {s[1]:>5}, {s[2]:>3} out: measured {m * 1e3:8.1f} ms, model {p * 1e3:8.1f} ms "
              f"({(p - m) / m:+.1%})")
    print(f"calibration error: mean |model - measured| / measured = {np.mean(np.abs(pred - y) / y):.1%}")


def main() -> None:
    asyncio.run(main_async())


if __name__ == "__main__":
    main()
