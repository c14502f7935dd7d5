"""Steady mixed RL load through a router, every request recorded: agent sessions, GRPO groups and
``/v1/score`` fan-outs (used by ``bench.fault`` and ``tests/router/test_fault_vllm.py``).

Each worker runs its kind in a loop until :meth:`MixedLoad.stop` or, with the kind's limit, after
that many sessions / groups / scorings (so two runs do the same work). Prompts are seeded token IDs,
generation is greedy with ``ignore_eos`` (a request of ``max_tokens`` m decodes exactly m tokens,
a scoring request of K responses decodes K, one per engine request), so the tokens a client
received can be compared with the replicas' own ``vllm:generation_tokens_total``.
A scoring answer is checked whole: K results, one finite logprob per response token, and rows
equal to the first answer to the same request (``reference``).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.workloads import random_tokens

REQUEST_TIMEOUT_S = 120.0
MAX_ITERATIONS = 100_000
"""Bound on any worker's loop (it normally ends on ``stop()`` or ``limit``)."""


@dataclass(frozen=True)
class MixedWorkload:
    """Concurrency, shape and pace of each kind; the limits make two runs do the same work."""

    sessions: int = 3
    session_turns: int = 6
    first_prompt_tokens: int = 600
    observation_tokens: int = 100
    reply_tokens: int = 32
    groups: int = 1
    group_size: int = 4
    group_prompt_tokens: int = 500
    sample_tokens: int = 16
    scorers: int = 1
    score_pool: int = 4
    score_context_tokens: int = 400
    score_responses: int = 3
    score_response_tokens: int = 12
    think_s: float = 0.05
    """Pause after each session turn (the environment's step)."""
    group_think_s: float = 0.05
    score_think_s: float = 0.05
    limit: int | None = None
    """Sessions per session worker; None = until stopped."""
    group_limit: int | None = None
    """Groups per group worker; None = until stopped."""
    score_limit: int | None = None
    """Scoring requests per scorer; None = until stopped."""
    seed: int = 11
    vocab_size: int = 1000


@dataclass(frozen=True)
class Record:
    """One request as its client saw it; ``sent``/``done`` on ``time.monotonic()``; ``decoded``:
    tokens decoded for it that reached the client (0 unless 200); ``problem``: why it counts as lost."""

    kind: str
    key: str
    status: int
    replica: str
    attempt: int
    sent: float
    done: float
    decoded: int
    problem: str = ""


@dataclass
class MixedLoad:
    """Run :class:`MixedWorkload` against ``url`` (``start``, then ``stop`` or ``wait``)."""

    http: aiohttp.ClientSession
    url: str
    w: MixedWorkload
    tag: str = "load"
    reference: dict[int, list[list[float]]] = field(default_factory=dict)
    """Scoring rows by pool index: the first 200 answer, or given (another run's)."""
    records: list[Record] = field(default_factory=list)
    in_flight: dict[str, float] = field(default_factory=dict)
    """Session key -> when its current turn was sent."""
    last_replica: dict[str, str] = field(default_factory=dict)
    """Session key -> the replica that served its last turn."""

    def __post_init__(self) -> None:
        self._stop = asyncio.Event()
        self._go = asyncio.Event()
        self._go.set()
        self._tasks: list[asyncio.Task] = []
        self._timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        rng = random.Random(f"{self.w.seed}:score")
        self._pool = [(random_tokens(rng, self.w.score_context_tokens, self.w.vocab_size),
                       [random_tokens(rng, self.w.score_response_tokens + k, self.w.vocab_size)
                        for k in range(self.w.score_responses)]) for _ in range(self.w.score_pool)]

    def start(self) -> None:
        w = self.w
        workers = ([self._sessions(i) for i in range(w.sessions)] + [self._groups(i) for i in range(w.groups)]
                   + [self._scores(i) for i in range(w.scorers)])
        self._tasks = [asyncio.ensure_future(c) for c in workers]

    async def stop(self) -> list[Record]:
        """Let every worker finish the request it is on, then return the records."""
        self._stop.set()
        self._go.set()
        return await self.wait()

    def pause(self) -> None:
        """Send nothing new until :meth:`resume` (requests in flight finish)."""
        self._go.clear()

    def resume(self) -> None:
        self._go.set()

    async def wait(self) -> list[Record]:
        await asyncio.gather(*self._tasks)
        return self.records

    def served_by(self, replica: str, after: float = -math.inf) -> list[Record]:
        """The 200s ``replica`` answered at or after ``after`` (``time.monotonic()``)."""
        return [r for r in self.records if r.status == 200 and r.replica == replica and r.done >= after]

    def _iterations(self, limit: int | None):
        for i in range(MAX_ITERATIONS if limit is None else limit):
            if self._stop.is_set():
                return
            yield i

    async def _post(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[int, Any, Any, float]:
        await self._go.wait()
        sent = time.monotonic()
        try:
            async with self.http.post(self.url + path, json=body, headers=headers, timeout=self._timeout) as r:
                return r.status, await r.json(content_type=None), r.headers, sent
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            return -1, {"error": {"message": repr(exc)}}, {}, sent

    def _record(self, kind: str, key: str, status: int, payload: Any, headers: Any, sent: float,
                decoded: int, problem: str = "") -> Record:
        if status != 200 and not problem:
            problem = str((payload or {}).get("error", {}).get("message", ""))[:200] if isinstance(payload, dict) else ""
        rec = Record(kind, key, status, headers.get("X-Rollout-Replica", ""), int(headers.get("X-Rollout-Attempt", 0)),
                     sent, time.monotonic(), decoded if status == 200 and not problem else 0, problem)
        self.records.append(rec)
        return rec

    async def _sessions(self, worker: int) -> None:
        w = self.w
        for s in self._iterations(w.limit):
            key = f"{self.tag}-s{worker}-{s}"
            rng = random.Random(f"{w.seed}:{key}")
            prompt = random_tokens(rng, w.first_prompt_tokens, w.vocab_size)
            for turn in range(w.session_turns):
                if self._stop.is_set():
                    break
                body = {"prompt": prompt, "max_tokens": w.reply_tokens, "temperature": 0, "ignore_eos": True,
                        "return_token_ids": True, "end_session": turn == w.session_turns - 1}
                self.in_flight[key] = time.monotonic()
                status, payload, headers, sent = await self._post("/v1/completions", body, {"X-Session-Id": key})
                self.in_flight.pop(key, None)
                rec = self._record("session", key, status, payload, headers, sent, w.reply_tokens)
                if status != 200:
                    break  # a client would start over; the failure is on record
                self.last_replica[key] = rec.replica
                prompt = prompt + payload["choices"][0]["token_ids"] + random_tokens(rng, w.observation_tokens,
                                                                                     w.vocab_size)
                await asyncio.sleep(w.think_s)

    async def _groups(self, worker: int) -> None:
        w = self.w
        for g in self._iterations(w.group_limit):
            key = f"{self.tag}-g{worker}-{g}"
            prompt = random_tokens(random.Random(f"{w.seed}:{key}"), w.group_prompt_tokens, w.vocab_size)
            body = {"prompt": prompt, "max_tokens": w.sample_tokens, "temperature": 0, "ignore_eos": True}
            answers = await asyncio.gather(*(self._post("/v1/completions", body, {"X-Group-Id": key})
                                             for _ in range(w.group_size)))
            for status, payload, headers, sent in answers:
                self._record("group", key, status, payload, headers, sent, w.sample_tokens)
            await asyncio.sleep(w.group_think_s)

    async def _scores(self, worker: int) -> None:
        w = self.w
        for n in self._iterations(w.score_limit):
            index = (worker + n) % len(self._pool)
            context, responses = self._pool[index]
            status, payload, headers, sent = await self._post("/v1/score", {"context": context, "responses": responses},
                                                             {})
            problem = check_score(payload, responses, self.reference.get(index)) if status == 200 else ""
            if status == 200 and not problem:
                self.reference.setdefault(index, [r["logprobs"] for r in payload["results"]])
            self._record("score", f"{self.tag}-p{index}", status, payload, headers, sent, len(responses), problem)
            await asyncio.sleep(w.score_think_s)


def check_score(payload: Any, responses: list[list[int]], reference: list[list[float]] | None) -> str:
    """'' when ``payload`` is a whole scoring answer to ``responses`` (and equals ``reference``,
    if given); else what is wrong: ``partial`` (a result or a row missing, not finite) or ``mismatch``."""
    results = payload.get("results") if isinstance(payload, dict) else None
    if not isinstance(results, list) or len(results) != len(responses):
        return "partial"
    rows = [r.get("logprobs") if isinstance(r, dict) else None for r in results]
    for row, response in zip(rows, responses):
        if (not isinstance(row, list) or len(row) != len(response)
                or not all(isinstance(x, float) and math.isfinite(x) for x in row)):
            return "partial"
    return "mismatch" if reference is not None and rows != reference else ""
