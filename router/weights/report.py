"""What an answer says about the weights that computed it (README "Version contract").

Every answer's ``rollout_router`` object carries, beside its replica and salt::

    weight_version     the version whose weights computed its last tokens
    weight_versions    every version whose weights computed some of its tokens, in order
    kv_versions        the versions whose KV it may have reused (its salt's version when salted)
    hybrid             some token was computed by one version's weights over another's KV
    spans              [{"weight_version", "kv_versions", "hybrid", "from_token": {choice: n}}]:
                       one per version its tokens came from; ``from_token`` counts the tokens
                       of each choice streamed before the span began (streams only change span)
    reruns             times a weight update made it run again whole (nothing had reached you)

A span's ``kv_versions`` is an upper bound the core can prove (``DecisionCore.kv_versions``),
narrowed to its own version when the answer says no prompt token came from the cache.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cache_policy.core import DecisionCore, Job


def first_span(core: DecisionCore, job: Job) -> dict[str, Any]:
    """The span a dispatched ``job`` starts with: its replica's version over the KV it may reuse."""
    return span(job.weight_version, core.kv_versions(job), {}, ordered=True)


def span(version: int | None, kv_versions: list[int], from_token: dict[int, int], *,
         ordered: bool = False) -> dict[str, Any]:
    """One span of tokens computed by ``version``'s weights over KV of ``kv_versions``;
    ``ordered``: they are ascending, each once, already (``DecisionCore.kv_versions``: under
    ``keep`` every version since the replica's last reset, 20,000 after a week of updates, which
    sorting again took 0.35 ms per answer)."""
    kv = list(kv_versions) if ordered else sorted(set(kv_versions))
    return {"weight_version": version, "kv_versions": kv, "hybrid": any(v != version for v in kv),
            "from_token": dict(from_token)}


def next_span(spans: list[dict[str, Any]], tokens: dict[int, int], new: int, recomputed: bool) -> dict[str, Any]:
    """The span a kept stream enters when its replica resumes on ``new``: over its old KV and the
    new (``keep``: the hybrid the seed allows), or over new KV only when the update preempted it
    and it recomputed its whole context (``recomputed``)."""
    last = spans[-1]
    kv = [new] if recomputed else [*last["kv_versions"], last["weight_version"], new]
    return span(new, [v for v in kv if v is not None], tokens)


def version_note(core: DecisionCore, job: Job, spans: list[dict[str, Any]] | None, cached: int | None,
                 reruns: int = 0, tokens: dict[int, int] | None = None) -> dict[str, Any]:
    """The version fields of ``job``'s answer (module docstring). ``spans``: its flight's (None:
    one span from now); ``cached``: the prompt tokens the replica says it reused, if it said;
    ``tokens``: a stream's final token counts per choice (spans without a token are dropped)."""
    spans = spans or [first_span(core, job)]
    if len(spans) == 1:  # most answers: one version from dispatch to end, the fields read off it
        one = spans[0]
        version = one["weight_version"]
        if cached == 0 and version is not None:  # nothing reused: its own KV only
            one = span(version, [version], one["from_token"])
        else:
            one = dict(one)
        return {"weight_version": job.spec.weight_version if version is None else version,
                "weight_versions": [] if version is None else [version], "kv_versions": list(one["kv_versions"]),
                "hybrid": one["hybrid"], "spans": [one], "reruns": reruns}
    return _note_of(job, spans, cached, reruns, tokens)


def _note_of(job: Job, spans: list[dict[str, Any]], cached: int | None, reruns: int,
             tokens: dict[int, int] | None) -> dict[str, Any]:
    """:func:`version_note` over any number of spans (the general rule its one-span case follows)."""
    spans = [dict(s) for s in spans]
    if tokens is not None and len(spans) > 1:
        spans = trim(spans, tokens)
    if cached == 0 and spans[0]["weight_version"] is not None:  # nothing reused: its own KV only
        spans[0] = span(spans[0]["weight_version"], [spans[0]["weight_version"]], spans[0]["from_token"])
    versions = [s["weight_version"] for s in spans if s["weight_version"] is not None]
    kv = sorted({v for s in spans for v in s["kv_versions"]})
    return {"weight_version": versions[-1] if versions else job.spec.weight_version,
            "weight_versions": list(dict.fromkeys(versions)), "kv_versions": kv,
            "hybrid": any(s["hybrid"] for s in spans), "spans": spans, "reruns": reruns}


def trim(spans: list[dict[str, Any]], tokens: dict[int, int]) -> list[dict[str, Any]]:
    """``spans`` without those that hold no token of any choice (a stream that ended, or had not
    begun, before its replica's update); never empty."""
    ends = [s["from_token"] for s in spans[1:]] + [tokens]
    kept = [s for s, end in zip(spans, ends)
            if any(end.get(c, 0) > s["from_token"].get(c, 0) for c in set(end) | set(s["from_token"]))]
    return kept or spans[-1:]


def chunk_tokens(choice: dict[str, Any]) -> int:
    """Tokens one streamed choice delta carries: its ``token_ids`` or logprob entries when
    present, else one per non-empty delta (vLLM streams one engine step per chunk)."""
    if isinstance(choice.get("token_ids"), list):
        return len(choice["token_ids"])
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict):
        entries = logprobs.get("content") if "content" in logprobs else logprobs.get("tokens")
        if isinstance(entries, list):
            return len(entries)
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return int(any(delta.get(k) for k in ("content", "reasoning_content", "reasoning", "tool_calls")))
    return int(bool(choice.get("text")))


class StreamWatch:
    """Counts a relayed stream's tokens per choice (into ``tokens``, the flight's counters, read
    by a weight update at its boundary) and gives its final chunk the ``rollout_router`` object
    (``note(cached)``)."""

    ended: str | None = None
    """Why the stream was ended from outside (:meth:`end`), for its error event."""

    def __init__(self, tokens: dict[int, int], note) -> None:
        self.tokens = tokens
        self._note = note
        self._close: Callable[[], None] | None = None

    def relaying(self, close: Callable[[], None] | None) -> None:
        """The stream's upstream response is open and ``close`` closes it; None once the relay
        ended (``router.proxy.relay_stream``)."""
        self._close = close

    def end(self, reason: str) -> bool:
        """End the stream now (``Lifecycle.left_paused``): its upstream response is closed, so the
        relay ends it with an error event saying ``reason`` (once answering; before, the request
        runs again elsewhere). False when it is not relaying (yet, or any more)."""
        if self._close is None or self.ended is not None:
            return False
        self.ended = reason
        self._close()
        return True

    def on_event(self, event: dict[str, Any]) -> None:
        """One ``data:`` event of the stream, decoded."""
        for choice in event.get("choices") or []:
            if isinstance(choice, dict):
                idx = choice.get("index", 0)
                self.tokens[idx] = self.tokens.get(idx, 0) + chunk_tokens(choice)

    def final(self, cached: int | None) -> dict[str, Any]:
        """The ``rollout_router`` object of the final chunk."""
        return self._note(cached)
