"""One simulated vLLM replica in real time: the simulator's engine model driven by the event loop.

``bench.sim.engine.Engine`` has no clock of its own; here its clock is ``loop.time()`` minus the
replica's start. A request is submitted at "now" after every step that should already have ended
is applied (so a late timer never reorders events), and a timer is re-armed at ``wake_at`` whenever
the engine's ``epoch`` changes. Prefilled tokens are therefore counted exactly as the engine model
counts them (``EngineStats``: prompt tokens minus prefix-cache hits at first scheduling).

Output tokens are unknown to the replica's client (it cannot tell the replica what to sample), so
a request's output blocks get unique hashes (``SequenceHashes.with_unique_tail``): a later prompt
that contains a reply reuses its prompt part only. ``bench.h2h.ideal`` counts the same way.

A zero-cost replica (``CostModel(0, 0, 0, 0)``) finishes every request at its submit time: the
answer goes out at once (the router-added latency measurement).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass

from bench.sim.cost import CostModel
from bench.sim.engine import Engine, EngineConfig, SimRequest
from bench.sim.seqhash import SequenceHashes

log = logging.getLogger(__name__)

ZERO_COST = CostModel(step=0.0, seq=0.0, token=0.0, key=0.0)
"""Every step takes no time: a request finishes at its submit time."""

FAST_COST = CostModel(step=1.0e-3, seq=2.0e-5, token=1.0e-6, key=2.0e-11)
"""A GPU-like step model (4,000-token prefill ~6 ms, a 32-sequence decode step ~1.6 ms), so a
workload of thousands of requests runs in seconds of wall time on loopback."""


@dataclass
class Answer:
    """What one finished engine request reports back (tokens)."""

    prompt_tokens: int
    cached_tokens: int
    output_tokens: int


class SimReplica:
    """A real-time engine: ``await generate(...)`` submits one request and waits for it to finish.

    ``name``: the replica's id; ``cfg``: the engine's size, block size and cost model;
    ``hashes``: one ``SequenceHashes`` for the whole fleet (same block size)."""

    _ids = itertools.count()

    def __init__(self, name: str, cfg: EngineConfig, hashes: SequenceHashes) -> None:
        if hashes.block_size != cfg.block_size:
            raise ValueError(f"SequenceHashes.block_size {hashes.block_size} != EngineConfig.block_size {cfg.block_size}")
        self.name, self.cfg, self.hashes = name, cfg, hashes
        self.reset()

    def reset(self) -> None:
        """A fresh engine: empty cache, counters at zero (between benchmark runs)."""
        self.engine = Engine(self.name, self.cfg)
        self._origin: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._epoch = self.engine.epoch
        self.generated = 0

    def _now(self) -> float:
        loop = asyncio.get_running_loop()
        if self._origin is None:
            self._origin = loop.time()
        return loop.time() - self._origin

    async def generate(self, prompt: list[int], max_tokens: int, salt: str | None) -> Answer:
        """Run one request of ``prompt`` tokens generating ``max_tokens``; its counts when done."""
        if not prompt:
            raise ValueError("prompt must hold at least one token")
        key = f"r{next(self._ids)}"
        h = self.hashes.hashes(key, salt, prompt)
        self.hashes.forget(key)
        full = self.hashes.with_unique_tail(h, len(prompt), len(prompt) + max_tokens)
        fut: asyncio.Future[SimRequest] = asyncio.get_running_loop().create_future()
        req = SimRequest(key, hashes=full, prompt_tokens=len(prompt), max_tokens=max(1, max_tokens), payload=fut)
        now = self._now()
        self._catch_up(now)
        self.engine.submit(req, now)
        self._catch_up(now)
        self._arm()
        done = await fut
        self.generated += done.output_tokens
        return Answer(done.prompt_tokens, done.cached_tokens, done.output_tokens)

    def _catch_up(self, now: float) -> None:
        """Apply every step that ended at or before ``now`` (in order), resolving finished requests."""
        eng = self.engine
        while eng.wake_at is not None and eng.wake_at <= now + 1e-12:
            for r in eng.wake(eng.wake_at):
                if not r.payload.done():
                    r.payload.set_result(r)

    def _arm(self) -> None:
        if self.engine.epoch == self._epoch and (self._timer is not None or self.engine.wake_at is None):
            return
        self._epoch = self.engine.epoch
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.engine.wake_at is not None and self._origin is not None:
            self._timer = asyncio.get_running_loop().call_at(self._origin + self.engine.wake_at, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        try:
            self._catch_up(self._now())
        except Exception:  # a bug in the model must not kill the server loop: log it once per event
            log.exception("replica %s: engine step failed", self.name)
        self._epoch = -1  # force re-arm
        self._arm()

    def metrics_text(self, model: str) -> str:
        """vLLM's ``/metrics`` series for this replica (Prometheus text format)."""
        e, s, c = self.engine, self.engine.stats, self.cfg
        lbl = f'engine="0",model_name="{model}"'
        lines = [
            "# TYPE vllm:num_requests_running gauge", f"vllm:num_requests_running{{{lbl}}} {e.num_running}",
            "# TYPE vllm:num_requests_waiting gauge", f"vllm:num_requests_waiting{{{lbl}}} {e.num_waiting}",
            "# TYPE vllm:kv_cache_usage_perc gauge", f"vllm:kv_cache_usage_perc{{{lbl}}} {e.kv_usage}",
            "# TYPE vllm:prefix_cache_queries counter", f"vllm:prefix_cache_queries_total{{{lbl}}} {float(s.prompt_tokens)}",
            "# TYPE vllm:prefix_cache_hits counter", f"vllm:prefix_cache_hits_total{{{lbl}}} {float(s.cached_tokens)}",
            "# TYPE vllm:prompt_tokens counter", f"vllm:prompt_tokens_total{{{lbl}}} {float(s.prompt_tokens)}",
            "# TYPE vllm:generation_tokens counter", f"vllm:generation_tokens_total{{{lbl}}} {float(self.generated)}",
            "# TYPE vllm:num_preemptions counter", f"vllm:num_preemptions_total{{{lbl}}} {float(s.preemptions)}",
            "# TYPE vllm:cache_config_info gauge",
            f'vllm:cache_config_info{{block_size="{c.block_size}",enable_prefix_caching="True",'
            f'num_gpu_blocks="{c.num_blocks}",engine="0"}} 1.0',
        ]
        return "\n".join(lines) + "\n"

    def stats(self) -> dict[str, int | float]:
        """The engine's counters (JSON-ready) for the benchmark."""
        s = self.engine.stats
        return {"requests": s.requests, "finished": s.finished, "prompt_tokens": s.prompt_tokens,
                "cached_tokens": s.cached_tokens, "prefilled_tokens": s.prefilled_tokens,
                "preemptions": s.preemptions, "busy_s": s.busy_s}

