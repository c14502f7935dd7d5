"""Drive one workload through one router over HTTP, in real time (``bench.sim.workloads.Clients``).

The clients are the simulator's own (GRPO groups, multi-turn agents with tool pauses); this sink
sends each item as one ``/v1/completions`` request with the router's routing-key headers and
calls the client back when it returns; a 429 or 503 is retried after its ``Retry-After``, twice at
most, as the ``openai`` SDK does by default (``RETRIES``), then counted as an error. Token IDs are folded into the tiny model's vocabulary
(``fold``) so our router's vocabulary check passes; prefix structure is unchanged.

``IdealCounter`` is the simulator's ideal (``bench.sim.metrics``): one infinite cache shared by
the fleet, a hit capped at ``num_tokens - 1`` block-rounded, each prompt block computed once;
output blocks never reused (as in ``bench.h2h.replica``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp

from bench.h2h.routers import RouterSpec
from bench.sim.seqhash import SequenceHashes
from bench.sim.workloads import Clients, Item, WorkloadConfig

RETRIES = 2
"""Retries of a 429 or 503 after its ``Retry-After``, as the ``openai`` SDK makes by default
(``max_retries=2``; it honours ``Retry-After`` up to 60 s)."""

VOCAB_LO, VOCAB_HI = 8, 1100
"""Prompt token IDs are folded into ``[VOCAB_LO, VOCAB_HI)`` (the tiny tokenizer has 1,130)."""


def fold(ids: list[int]) -> list[int]:
    """Map token IDs into ``[VOCAB_LO, VOCAB_HI)`` (deterministic, prefix-preserving)."""
    span = VOCAB_HI - VOCAB_LO
    return [VOCAB_LO + t % span for t in ids]


class IdealCounter:
    """Prefilled tokens with one infinite cache shared by every replica (a lower bound)."""

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.hashes = SequenceHashes(block_size)
        self.seen: set[int] = set()
        self.prefill = 0
        self.prompt = 0

    def add(self, key: str, prompt: list[int]) -> None:
        """Count one request of ``prompt`` (``key``: its growing sequence, for memoised hashing)."""
        h = self.hashes.hashes(key, None, prompt)
        hit = 0
        for x in h[: max(0, len(prompt) - 1) // self.bs]:
            if x not in self.seen:
                break
            hit += 1
        self.prefill += len(prompt) - hit * self.bs
        self.prompt += len(prompt)
        self.seen.update(h)


class HttpSink:
    """``bench.sim.workloads.Sink`` over HTTP to ``url`` for ``spec``; ``done`` is set when nothing is left."""

    def __init__(self, spec: RouterSpec, url: str, http: aiohttp.ClientSession, ideal: IdealCounter,
                 on_request: Callable[[], None] = lambda: None) -> None:
        self.spec, self.url, self.http, self.ideal, self.on_request = spec, url, http, ideal, on_request
        self.loop = asyncio.get_running_loop()
        self.t0 = self.loop.time()
        self.pending = 0
        self.done = asyncio.Event()
        self.ok = 0
        self.retries = 0
        """429/503 answers retried (``RETRIES`` per request at most)."""
        self.errors: dict[str, int] = {}
        self.tasks: set[asyncio.Task] = set()

    def now(self) -> float:
        return self.loop.time() - self.t0

    def issue(self, item: Item, now: float) -> None:
        if item.kind != "generate":
            raise ValueError(f"bench.h2h drives generation only, got {item.kind!r}")
        item.created_s = now
        prompt = fold(item.prompt)
        self.ideal.add(item.hash_key, prompt)
        self.pending += 1
        task = asyncio.ensure_future(self._send(item, prompt))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _send(self, item: Item, prompt: list[int]) -> None:
        body = {"model": "sim-model", "prompt": self.spec.prompt(prompt), "max_tokens": item.max_tokens[0]}
        headers = self.spec.headers(item.session_id, item.group_id, item.ends_session)
        try:
            for attempt in range(RETRIES + 1):
                async with self.http.post(f"{self.url}/v1/completions", json=body, headers=headers) as r:
                    await r.read()
                    wait = _retry_after(r)
                if r.status == 200:
                    self.ok += 1
                elif r.status in (429, 503) and attempt < RETRIES:
                    self.retries += 1
                    await asyncio.sleep(wait)
                    continue
                else:
                    self.errors[str(r.status)] = self.errors.get(str(r.status), 0) + 1
                break
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self.errors[type(exc).__name__] = self.errors.get(type(exc).__name__, 0) + 1
        self.on_request()
        try:
            if item.on_done is not None:
                item.on_done(item, self.now())
        finally:
            self._release()

    def after(self, delay_s: float, fn: Callable[[float], None]) -> None:
        self.pending += 1

        def fire() -> None:
            try:
                fn(self.now())
            finally:
                self._release()
        self.loop.call_later(delay_s, fire)

    def end_session(self, session_id: str, now: float) -> None:
        """Nothing to send: the last turn carried ``X-Session-End`` (ours); the Rust routers have no call."""

    def _release(self) -> None:
        self.pending -= 1
        if self.pending == 0:
            self.done.set()


async def run_workload(spec: RouterSpec, url: str, cfg: WorkloadConfig, kinds: set[str], replicas: int,
                       budget: int, seed: int, block_size: int, timeout_s: float,
                       on_request: Callable[[], None] = lambda: None) -> dict:
    """Issue ``budget`` requests of ``kinds`` through ``url``; returns counts, ideal and wall time.

    Raises TimeoutError past ``timeout_s`` (the loop is bounded by the budget anyway)."""
    ideal = IdealCounter(block_size)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:
        sink = HttpSink(spec, url, http, ideal, on_request)
        clients = Clients(cfg, kinds, replicas, budget, seed, sink)
        clients.start(0.0)
        if sink.pending == 0:
            sink.done.set()
        await asyncio.wait_for(sink.done.wait(), timeout_s)
        wall = sink.now()
    return {"requests_ok": sink.ok, "retries": sink.retries, "errors": sink.errors, "ideal_prefilled_tokens": ideal.prefill,
            "prompt_tokens": ideal.prompt, "wall_s": wall,
            "group_s_p50": _pct(clients.group_times, 50), "turn_s_p50": _pct(clients.turn_times, 50)}


def _retry_after(r: aiohttp.ClientResponse) -> float:
    """Seconds to wait before retrying ``r``: its ``Retry-After`` within [0, 60], else 1 (as the
    ``openai`` SDK waits)."""
    try:
        return min(max(float(r.headers.get("Retry-After", "1")), 0.0), 60.0)
    except ValueError:
        return 1.0


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]
