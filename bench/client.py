"""Drive workloads through a router (or any OpenAI-compatible server) over HTTP.

Each request becomes a `RequestRecord`: which replica served it, prompt tokens, the cached
tokens the replica reported (``usage.prompt_tokens_details.cached_tokens``), the router's
prediction, and latency.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Callable

import aiohttp

from bench.workloads import AgentWorkload, GrpoWorkload, agent_first_prompts, agent_observation, grpo_prompts


@dataclass(frozen=True)
class RequestRecord:
    """One completed request as the client saw it."""

    workload: str
    replica: str
    prompt_tokens: int
    cached_tokens: int
    expected_cached_tokens: int
    latency_s: float
    key: str
    retries: int = 0
    """429 answers retried before this request was admitted (``retry_cap_s`` set)."""


async def complete(http: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int,
                   headers: dict[str, str], workload: str, key: str,
                   retry_cap_s: float | None = None) -> tuple[RequestRecord, list[int]]:
    """One non-streamed /v1/completions call with a token-ID prompt; returns record and reply ids.

    With ``retry_cap_s`` a 429 is retried after its ``Retry-After`` (at most ``retry_cap_s``
    seconds); the latency then counts from the first attempt. Any other non-200 raises."""
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0,
                            "return_token_ids": True, "ignore_eos": True}
    started, retries = time.perf_counter(), 0
    while True:
        async with http.post(url + "/v1/completions", json=body, headers=headers) as r:
            payload = await r.json(content_type=None)
            if r.status == 429 and retry_cap_s is not None:
                retries += 1
                await asyncio.sleep(min(float(r.headers.get("Retry-After", "1")), retry_cap_s))
                continue
            if r.status != 200:
                raise RuntimeError(f"{workload} request failed with {r.status}: {payload}")
            break
    latency = time.perf_counter() - started
    usage = payload.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    router = payload.get("rollout_router") or {}
    reply = payload["choices"][0].get("token_ids") or []
    record = RequestRecord(workload, r.headers.get("X-Rollout-Replica", router.get("replica", "?")),
                           len(prompt), int(cached), int(router.get("expected_cached_tokens", 0)), latency, key,
                           retries)
    return record, reply


async def run_grpo(http: aiohttp.ClientSession, url: str, w: GrpoWorkload, vocab_size: int,
                   progress: Callable[[int], None] = lambda n: None) -> list[RequestRecord]:
    """Each group's ``group_size`` samples are sent at once, ``concurrent_groups`` groups at a time."""

    async def group(g: int, prompt: list[int]) -> list[RequestRecord]:
        headers = {"X-Group-Id": f"grpo-{w.seed}-{g}"}
        done = await asyncio.gather(*(complete(http, url, prompt, w.max_tokens, headers, "grpo", f"g{g}")
                                      for _ in range(w.group_size)))
        progress(w.group_size)
        return [rec for rec, _ in done]

    prompts = list(enumerate(grpo_prompts(w, vocab_size)))
    records: list[RequestRecord] = []
    step = max(1, w.concurrent_groups)
    for start in range(0, len(prompts), step):
        batch = await asyncio.gather(*(group(g, p) for g, p in prompts[start:start + step]))
        records += [rec for recs in batch for rec in recs]
    return records


async def run_agent(http: aiohttp.ClientSession, url: str, w: AgentWorkload, vocab_size: int,
                    progress: Callable[[int], None] = lambda n: None) -> list[RequestRecord]:
    """Sessions run concurrently; within one, turn k waits for turn k-1's reply."""

    async def session(s: int, prompt: list[int]) -> list[RequestRecord]:
        out = []
        headers = {"X-Session-Id": f"agent-{w.seed}-{s}"}
        for turn in range(w.turns):
            rec, reply = await complete(http, url, prompt, w.reply_tokens, headers, "agent", f"s{s}")
            out.append(rec)
            progress(1)
            prompt = prompt + reply + agent_observation(w, s, turn, vocab_size)
        return out

    per_session = await asyncio.gather(*(session(s, p) for s, p in enumerate(agent_first_prompts(w, vocab_size))))
    return [rec for recs in per_session for rec in recs]
