"""The event-driven fleet: clients -> router (``SimRouter``) -> N engine models, one clock.

Events (a heap of ``(time, seq, kind, a, b)``): an engine's step ends (``wake``, stale when the
engine's ``epoch`` moved on), a client timer (tool-call pause, retry), a load scrape (routers that
want one: every ``scrape_s``, all replicas). A trainer step hook bumps the weight version every
``update_every`` steps: under ``flush`` every engine resets its prefix cache.

What is measured is in ``bench.sim.metrics.Recorder``; the router's own time (open + place +
admit, and finish) is taken with ``perf_counter`` around its calls only.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

from bench.sim.engine import Engine, EngineConfig, SimRequest
from bench.sim.metrics import Recorder
from bench.sim.router import Handle, SimRouter
from bench.sim.seqhash import SequenceHashes
from bench.sim.workloads import Clients, Item, WorkloadConfig
from cache_policy.hashing import block_hashes

_WAKE, _CALL, _SCRAPE = 0, 1, 2


@dataclass(frozen=True)
class FleetConfig:
    """One run: fleet size, engine shape, workload mix and the weight-update cadence."""

    replicas: int = 4
    engine: EngineConfig = EngineConfig()
    workload: WorkloadConfig = WorkloadConfig()
    kinds: frozenset[str] = frozenset({"grpo", "agent", "opd"})
    requests: int = 10_000
    seed: int = 0
    update_every: int = 0
    """Trainer steps between weight updates (0: none)."""
    weight_policy: str = "keep+salt"
    scrape_s: float = 0.5
    bucket_s: float = 5.0


class Fleet:
    """Runs one ``SimRouter`` over ``cfg.replicas`` engines until every client is done."""

    def __init__(self, cfg: FleetConfig, router: SimRouter,
                 progress: Callable[[int], None] | None = None,
                 clients: Callable[[Fleet], Clients] | None = None) -> None:
        """``clients`` builds the traffic (default: ``Clients`` from ``cfg.workload``)."""
        self.cfg, self.router = cfg, router
        self.engines = [Engine(f"r{i}", cfg.engine) for i in range(cfg.replicas)]
        self.by_name = {e.name: e for e in self.engines}
        for e in self.engines:
            router.add_replica(e.name, cfg.engine.block_size, cfg.engine.num_blocks)
        self.seq = SequenceHashes(cfg.engine.block_size)
        self.rec = Recorder(cfg.engine.block_size, cfg.bucket_s, [e.name for e in self.engines])
        self.heap: list = []
        self._armed: dict[str, int] = {}
        self._calls = 0
        self._n = itertools.count()
        self.now = 0.0
        self.version = 0
        self.steps = 0
        self.progress = progress
        self.clients = clients(self) if clients is not None else Clients(
            cfg.workload, set(cfg.kinds), cfg.replicas, cfg.requests, cfg.seed, self, on_step=self._trainer_step)

    # -- Sink (what clients call) --------------------------------------------------------------
    def issue(self, item: Item, now: float) -> None:
        item.created_s = now
        self.rec.items_open += 1
        item.extra_left = item.fan_out  # type: ignore[attr-defined]
        groups = [(j,) for j in range(item.fan_out)] if self.router.split_fanout else [tuple(range(item.fan_out))]
        for subs in groups:
            self._route(item, subs, now)

    def after(self, delay_s: float, fn: Callable[[float], None]) -> None:
        self._calls += 1
        heapq.heappush(self.heap, (self.now + delay_s, next(self._n), _CALL, fn, None))

    def end_session(self, session_id: str, now: float) -> None:
        self._timed(lambda: self.router.end_key("session", session_id, now), decision=False)

    # -- routing -------------------------------------------------------------------------------
    def _timed(self, fn, decision: bool = True, opening: bool = False):
        t0 = time.perf_counter()
        out = fn()
        self.rec.router_time(time.perf_counter() - t0, decision, opening)
        return out

    def _route(self, item: Item, subs: tuple[int, ...], now: float) -> None:
        h = self._timed(lambda: self.router.open(item, subs, now), opening=True)
        self._place(h, now)

    def _place(self, h: Handle, now: float) -> None:
        if h.extra.get("hashed_salt", 0) != h.salt:
            self._hash(h)  # a refused job reopened under a newer version

        def go():
            rid = self.router.place(h, now)
            return rid, (self.router.admit(h, now) if rid is not None else None)
        rid, verdict = self._timed(go)
        self.rec.decisions += 1
        if rid is None or verdict == "reject":
            self.after(h.retry_after_s, lambda t: self._place(h, t))
        elif verdict == "admit":
            self._dispatch(h, now)

    def _hash(self, h: Handle) -> None:
        """Engine-side hashes of each sub-request (prompt + known output) under ``h.salt``."""
        item, bs = h.item, self.cfg.engine.block_size
        reqs = []
        for j in h.subs:
            if item.kind == "score":
                prompt = item.prompt + item.responses[j]
                full = tuple(block_hashes(prompt, bs, h.salt))
            elif item.outputs[j] is not None:
                prompt = item.prompt
                full = self.seq.hashes(item.hash_key, h.salt, prompt + item.outputs[j])
            else:
                prompt = item.prompt
                ph = self.seq.hashes(item.hash_key, h.salt, prompt)
                full = self.seq.with_unique_tail(ph, len(prompt), len(prompt) + item.max_tokens[j])
            reqs.append(SimRequest(f"{item.item_id}.{j}", full, len(prompt), item.max_tokens[j],
                                   cache_cap_tokens=item.score_start, payload=h))
        h.extra["reqs"] = reqs
        h.extra["hashed_salt"] = h.salt
        h.prompt_tokens = reqs[0].prompt_tokens
        h.hashes = reqs[0].hashes[: reqs[0].prompt_tokens // bs]

    def _dispatch(self, h: Handle, now: float) -> None:
        eng = self.by_name[h.replica]
        h.extra["left"] = len(h.subs)
        for r in h.extra["reqs"]:
            self.rec.dispatched(r, eng.name, now)
            eng.submit(r, now)
            self._arm(eng)

    def _pump(self, now: float) -> None:
        released = self._timed(lambda: self.router.pump(now), decision=False)
        for h, verdict in released:
            if verdict == "admit":
                self._dispatch(h, now)
            else:
                self.after(h.retry_after_s, lambda t, h=h: self._place(h, t))

    # -- completions ---------------------------------------------------------------------------
    def _finished(self, r: SimRequest, now: float) -> None:
        h: Handle = r.payload
        self.rec.finished(r, h.replica, now)
        h.extra["left"] -= 1
        if h.extra["left"]:
            return
        self._timed(lambda: self.router.finish(h, now), decision=False)
        item = h.item
        item.extra_left -= len(h.subs)  # type: ignore[attr-defined]
        if item.extra_left == 0:  # type: ignore[attr-defined]
            item.done_s = now
            self.rec.item_done(item, now)
            if self.progress is not None:
                self.progress(item.fan_out if item.kind == "score" else 1)
            if item.on_done is not None:
                item.on_done(item, now)

    def _trainer_step(self, now: float) -> None:
        self.steps += 1
        if self.cfg.update_every and self.steps % self.cfg.update_every == 0:
            self.version += 1
            self.rec.update_at(now, self.version)
            if self.cfg.weight_policy == "flush":
                for e in self.engines:
                    e.reset_prefix_cache()
                    self.router.cache_reset(e.name)
            self.router.weights_updated(self.version, now)

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> Recorder:
        """Run to completion; return the recorder (also ``self.rec``)."""
        self.clients.start(0.0)
        if self.router.wants_scrapes:
            heapq.heappush(self.heap, (0.0, next(self._n), _SCRAPE, None, None))
        heap, pop = self.heap, heapq.heappop
        while heap:
            t, _, kind, a, b = pop(heap)
            self.now = t
            if kind == _WAKE:
                if a.epoch != b:
                    continue
                done = a.wake(t)
                for r in done:
                    self._finished(r, t)
                self._arm(a)
                if done:
                    self._pump(t)
            elif kind == _CALL:
                self._calls -= 1
                a(t)
            elif self._busy():
                for e in self.engines:
                    self.router.observe(e.name, e, t)
                self._pump(t)
                heapq.heappush(heap, (t + self.cfg.scrape_s, next(self._n), _SCRAPE, None, None))
        self.rec.close(self.engines, self.now)
        return self.rec

    def _arm(self, eng: Engine) -> None:
        """Schedule ``eng``'s wake-up once per epoch (older entries are skipped as stale)."""
        if eng.wake_at is not None and self._armed.get(eng.name) != eng.epoch:
            self._armed[eng.name] = eng.epoch
            heapq.heappush(self.heap, (eng.wake_at, next(self._n), _WAKE, eng, eng.epoch))

    def _busy(self) -> bool:
        return self.rec.items_open > 0 or self._calls > 0
