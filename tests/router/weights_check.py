"""Checking what answers claim about weight versions against the checkpoints themselves.

A :class:`Claim` says "these tokens' logprobs were computed by version v's weights" (a scoring
row, a generated token, a span of a stream). :func:`verify` loads each checkpoint into the
replica in turn and scores the same tokens fresh (a salt nobody else uses: nothing cached), then
counts claims whose values match the claimed checkpoint, another checkpoint, or none.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

import aiohttp

from replicas.weights import update_weights

ATOL = 2e-3
"""Decode and prefill round differently on CPU (~1e-5); two checkpoints differ by nats."""


@dataclass
class Claim:
    """``logprobs[i]`` is the logprob of ``tokens[start + i]`` under version ``version``."""

    version: int
    tokens: list[int]
    start: int
    logprobs: list[float]
    what: str = ""


@dataclass
class Verdict:
    checked: int = 0
    rows: int = 0
    mismatched: list[str] = field(default_factory=list)
    """Claims whose rows match another checkpoint, not the claimed one."""
    unmatched: list[str] = field(default_factory=list)
    """Claims with a row that matches no checkpoint."""


async def fresh_rows(http: aiohttp.ClientSession, base: str, tokens: list[int], start: int) -> list[float]:
    """Logprobs of ``tokens[start:]`` under the weights the replica serves now, nothing cached."""
    body = {"model": "tiny-llama", "prompt": tokens, "max_tokens": 1, "prompt_logprobs": 0,
            "cache_salt": f"fresh-{random.random()}"}
    async with http.post(base + "/v1/completions", json=body) as r:
        payload = await r.json()
        assert r.status == 200, payload
    table = payload["choices"][0]["prompt_logprobs"]
    return [table[i][str(tokens[i])]["logprob"] for i in range(start, len(tokens))]


async def verify(http: aiohttp.ClientSession, base: str, claims: list[Claim], checkpoints: dict[int, str]) -> Verdict:
    """Score every claim fresh under every checkpoint (``version -> folder``); the replica ends on
    the last checkpoint of ``checkpoints`` with an empty cache."""
    truth: dict[int, list[list[float]]] = {}
    for version, path in checkpoints.items():
        result = await update_weights(http, base, path, reset_prefix_cache=True)
        assert result.ok, result
        truth[version] = [await fresh_rows(http, base, c.tokens, c.start) for c in claims]
    verdict = Verdict()
    for i, claim in enumerate(claims):
        verdict.checked += 1
        verdict.rows += len(claim.logprobs)
        close = {v: _close(claim.logprobs, rows[i]) for v, rows in truth.items()}
        if not close[claim.version]:
            target = verdict.mismatched if any(close.values()) else verdict.unmatched
            target.append(f"{claim.what} claims v{claim.version}, matches {[v for v, ok in close.items() if ok]}")
    return verdict


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= ATOL for x, y in zip(a, b))


def stream_claims(prompt: list[int], events: list[dict], what: str) -> tuple[list[Claim], dict, list[int]]:
    """The claims of one streamed completion (``logprobs`` and ``return_token_ids`` asked): one per
    span that is not hybrid. Returns (claims, the final chunk's ``rollout_router``, token ids)."""
    tokens: list[int] = []
    logprobs: list[float] = []
    note = None
    for event in events:
        for choice in event.get("choices") or []:
            ids = choice.get("token_ids") or []
            tokens += ids
            logprobs += (choice.get("logprobs") or {}).get("token_logprobs") or []
        if "rollout_router" in event:
            note = event["rollout_router"]
    assert note is not None, f"{what}: no rollout_router in the final chunk"
    assert len(tokens) == len(logprobs), what
    bounds = [int(s["from_token"].get("0", 0)) for s in note["spans"]] + [len(tokens)]
    claims = []
    for span, a, b in zip(note["spans"], bounds, bounds[1:]):
        if b > a and not span["hybrid"]:
            claims.append(Claim(span["weight_version"], prompt + tokens[:b], len(prompt) + a, logprobs[a:b],
                                f"{what} span v{span['weight_version']} tokens {a}:{b}"))
    return claims, note, tokens


async def read_events(resp: aiohttp.ClientResponse, buf: bytes = b"") -> list[dict]:
    """The ``data:`` events of a server-sent-events answer, up to ``[DONE]`` (``buf``: bytes already read)."""
    events: list[dict] = []

    def parse(buf: bytes) -> bytes:
        while b"\n\n" in buf:
            raw, buf = buf.split(b"\n\n", 1)
            if raw.startswith(b"data:") and raw[5:].strip() != b"[DONE]":
                events.append(json.loads(raw[5:]))
        return buf

    buf = parse(buf)
    async for chunk in resp.content.iter_any():
        buf = parse(buf + chunk)
    return events
