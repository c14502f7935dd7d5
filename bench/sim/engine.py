"""A model of one vLLM v1 engine: scheduler, prefix cache and step clock (pure, deterministic).

Follows ``vllm/v1/core/sched/scheduler.py`` (vLLM 0.32, FCFS policy) step by step:

1. RUNNING requests in order get ``min(tokens left, token budget)`` tokens (chunked prefill
   or one decode token). When their blocks do not fit, the *last* running request is
   preempted (``running.pop()``): its blocks are freed tail first, ``computed = 0``, and it
   goes to the front of WAITING (recompute policy). If it was the request itself, stop.
2. Only when nothing was preempted, WAITING requests are admitted in order while
   ``len(running) < max_num_seqs`` and budget remains: the longest cached prefix is looked
   up, capped at ``num_tokens - 1`` tokens (the last prompt token is always recomputed, so a
   prompt of whole blocks hits one block less) and, for scoring requests, at
   ``cache_cap_tokens`` (the S-bounded cap), both rounded down to a block. The first
   request that does not fit stops admission.
   Blocks a step will fill are cached when they are scheduled (hashes from
   ``SimRequest.hashes``), as ``allocate_slots`` does: a request admitted later in the same step
   hits them (a GRPO group's samples arriving together prefill their prompt once).
3. At the step's end every scheduled chunk counts as computed, a request with all known tokens
   computed samples one token, and a request at ``max_tokens`` finishes and frees its blocks
   tail first.

The block pool is ``bench.sim.kvpool.BlockPool`` (vLLM's eviction order). Step time is
``bench.sim.cost.CostModel``. For speed, consecutive decode-only steps with nothing able to
join are folded into one event (``max_decode_run``); an arrival truncates the run at the
step in progress, so results are the same as stepping one by one.

A server loop drives it: ``submit(req, now)``; whenever ``wake_at`` changes (``epoch`` bumps),
(re)arm a timer; at ``wake_at`` call ``wake(now)``, which returns the finished requests.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from bench.sim.cost import CostModel
from bench.sim.kvpool import BlockPool
from bench.sim.request import EngineStats, SimRequest

__all__ = ["CostModel", "Engine", "EngineConfig", "EngineStats", "SimRequest"]


@dataclass(frozen=True)
class EngineConfig:
    """One engine's size and scheduler limits (vLLM's names)."""

    num_blocks: int = 4096
    """KV cache size in blocks (``num_gpu_blocks``)."""
    block_size: int = 16
    """Tokens per block; must equal the block size the request hashes were computed with."""
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    """Token budget of one step (chunked prefill)."""
    cost: CostModel = field(default_factory=CostModel)
    max_decode_run: int = 64
    """Decode-only steps folded into one event at most (1 = step by step)."""

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_decode_run"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")


class Engine:
    """One replica. ``waiting`` (FCFS deque) and ``running`` (list, scheduling order);
    ``wake_at`` is the end of the step in progress (None when idle)."""

    def __init__(self, name: str, cfg: EngineConfig) -> None:
        self.name = name
        self.cfg = cfg
        self.pool = BlockPool(cfg.num_blocks)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.stats = EngineStats()
        self.wake_at: float | None = None
        self.epoch = 0
        self._batch: list[tuple[SimRequest, int]] = []
        self._run: list[float] = []  # cumulative end offsets of a decode run
        self._start = 0.0

    # ---- the server loop's calls -------------------------------------------------------
    def submit(self, req: SimRequest, now: float) -> None:
        """Queue ``req`` (arrival at ``now``); start a step if idle, or cut a decode run short."""
        if not 0 < req.prompt_tokens:
            raise ValueError(f"prompt_tokens must be positive, got {req.prompt_tokens}")
        req.arrival_s = now
        req.num_tokens = req.prompt_tokens
        self.waiting.append(req)
        self.stats.requests += 1
        if self.wake_at is None:
            self._begin(now)
        elif len(self._run) > 1:
            self._truncate(now)

    def wake(self, now: float) -> list[SimRequest]:
        """Finish the step (or decode run) ending at ``now``; start the next; return finished."""
        assert self.wake_at is not None and abs(now - self.wake_at) < 1e-9, "bug: woken off schedule"
        steps = max(1, len(self._run))
        self.stats.busy_s += now - self._start
        self.stats.steps += steps
        finished = self._apply(steps, now)
        self._begin(now)
        return finished

    def reset_prefix_cache(self) -> int:
        """Forget every cached block hash (vLLM ``reset_prefix_cache``); return how many."""
        for r in self.running:
            r.num_hashed = len(r.blocks)  # blocks computed so far stay uncached
        return self.pool.reset()

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_usage(self) -> float:
        """``vllm:kv_cache_usage_perc``: fraction of blocks referenced by requests."""
        return self.pool.usage

    # ---- scheduling ----------------------------------------------------------------------
    def _begin(self, now: float) -> None:
        self._start = now
        batch, preempted = self._schedule()
        self._batch = batch
        self._run = []
        self.epoch += 1
        if not batch:
            self.wake_at = None
            return
        n = self._decode_run_length(batch, preempted)
        if n > 1:
            keys0 = sum(r.computed + 1 for r, _ in batch)
            self._run = self.cfg.cost.decode_run(len(batch), keys0, n)
            self.wake_at = now + self._run[-1]
            return
        tokens = sum(k for _, k in batch)
        pairs = sum(k * r.computed + k * (k + 1) / 2 for r, k in batch)
        self.wake_at = now + self.cfg.cost.step_time(len(batch), tokens, pairs)

    def _schedule(self) -> tuple[list[tuple[SimRequest, int]], bool]:
        budget = self.cfg.max_num_batched_tokens
        batch: list[tuple[SimRequest, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            r = self.running[i]
            n = min(r.num_tokens - r.computed, budget)
            need = self._blocks_for(r.computed + n) - len(r.blocks)
            fits = True
            while need > self.pool.num_free:
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is r:
                    fits = False
                    break
            if not fits:
                break
            r.blocks.extend(self.pool.take(need))
            self._cache_upto(r, min(r.computed + n, r.num_tokens))
            batch.append((r, n))
            budget -= n
            i += 1
        if not preempted:
            budget = self._admit(batch, budget)
        return batch, preempted

    def _admit(self, batch: list[tuple[SimRequest, int]], budget: int) -> int:
        bs, pool = self.cfg.block_size, self.pool
        while self.waiting and len(self.running) < self.cfg.max_num_seqs and budget > 0:
            r = self.waiting[0]
            hits = pool.lookup(r.hashes, self._max_hit_blocks(r))
            hit_tokens = len(hits) * bs
            n = min(r.num_tokens - hit_tokens, budget)
            need = self._blocks_for(hit_tokens + n) - len(hits)
            if need + pool.evictable_among(hits) > pool.num_free:
                break
            self.waiting.popleft()
            pool.touch(hits)
            r.blocks = hits + pool.take(need)
            r.computed = hit_tokens
            r.num_hashed = len(hits)
            self._cache_upto(r, min(hit_tokens + n, r.num_tokens))
            if r.num_preemptions == 0:
                r.cached_tokens = hit_tokens
                self.stats.prompt_tokens += r.prompt_tokens
                self.stats.cached_tokens += hit_tokens
            else:
                self.stats.recomputed_tokens += r.num_tokens - hit_tokens
            self.running.append(r)
            batch.append((r, n))
            budget -= n
        return budget

    def _cache_upto(self, r: SimRequest, tokens: int) -> None:
        """Cache ``r``'s full blocks up to ``tokens``: vLLM ``allocate_slots`` caches the blocks a
        step *will* compute when it schedules them, so a request scheduled later in the same step
        already hits them."""
        full = min(tokens // self.cfg.block_size, len(r.hashes))
        for j in range(r.num_hashed, full):
            self.pool.cache(r.blocks[j], r.hashes[j])
        if full > r.num_hashed:
            r.num_hashed = full

    def _max_hit_blocks(self, r: SimRequest) -> int:
        limit = r.num_tokens - 1
        if r.cache_cap_tokens is not None:
            limit = min(limit, r.cache_cap_tokens)
        return max(0, limit) // self.cfg.block_size

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.cfg.block_size)

    def _preempt(self, r: SimRequest) -> None:
        self.pool.free(reversed(r.blocks))
        r.blocks = []
        r.computed = 0
        r.num_hashed = 0
        r.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(r)

    def _decode_run_length(self, batch: list[tuple[SimRequest, int]], preempted: bool) -> int:
        if preempted or self.cfg.max_decode_run == 1 or len(batch) != len(self.running):
            return 1
        if any(k != 1 or r.num_tokens - r.computed != 1 for r, k in batch):
            return 1
        n = min(self.cfg.max_decode_run, min(r.max_tokens - r.output_tokens for r, _ in batch))
        while n > 1 and self._extra_blocks(batch, n) > self.pool.num_free:
            n //= 2
        return max(1, n)

    def _extra_blocks(self, batch: list[tuple[SimRequest, int]], n: int) -> int:
        return sum(self._blocks_for(r.computed + n) - len(r.blocks) for r, _ in batch)

    def _truncate(self, now: float) -> None:
        done = sum(1 for t in self._run if self._start + t <= now + 1e-12)
        keep = min(len(self._run), done + 1)
        if keep < len(self._run):
            self._run = self._run[:keep]
            self.wake_at = self._start + self._run[-1]
            self.epoch += 1

    # ---- step end ------------------------------------------------------------------------
    def _apply(self, steps: int, now: float) -> list[SimRequest]:
        pool = self.pool
        finished: list[SimRequest] = []
        for r, k in self._batch:
            if steps > 1:
                extra = self._blocks_for(r.computed + steps) - len(r.blocks)
                if extra > 0:
                    r.blocks.extend(pool.take(extra))
                k = steps
            r.computed += k
            self._cache_upto(r, r.computed)
            if r.computed >= r.num_tokens:
                sampled = k if steps > 1 else 1
                r.num_tokens += sampled
                r.output_tokens += sampled
                if r.first_token_s is None:
                    r.first_token_s = now
                if r.output_tokens >= r.max_tokens:
                    r.finish_s = now
                    finished.append(r)
        if finished:
            done = set(map(id, finished))
            self.running = [r for r in self.running if id(r) not in done]
            for r in finished:
                pool.free(reversed(r.blocks))
                r.blocks = []
            self.stats.finished += len(finished)
        return finished
