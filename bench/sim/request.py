"""What the engine model is given (``SimRequest``) and what it counts (``EngineStats``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)
class SimRequest:
    """One request to one engine.

    ``hashes``: chained hashes of the full blocks of prompt + output tokens (block size of
    the engine; ``bench.sim.seqhash``); the prompt's are looked up, all are cached once
    computed. ``cache_cap_tokens``: a scoring request's S (the cached hit is capped at
    ``min(S, num_tokens - 1)`` rounded down to a block); None for generation.
    The engine fills the fields after ``payload``; times are simulated seconds.
    """

    req_id: str
    hashes: tuple[int, ...]
    prompt_tokens: int
    max_tokens: int
    cache_cap_tokens: int | None = None
    payload: object = None
    arrival_s: float = 0.0
    first_token_s: float | None = None
    finish_s: float | None = None
    cached_tokens: int = 0
    num_preemptions: int = 0
    output_tokens: int = 0
    # scheduler state
    num_tokens: int = 0
    computed: int = 0
    num_hashed: int = 0
    blocks: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass
class EngineStats:
    """Counters of one engine, as vLLM's /metrics would report them.

    ``prompt_tokens`` / ``cached_tokens``: at a request's first scheduling only
    (``vllm:prompt_tokens_total``, ``vllm:prefix_cache_hits_total``), so prefilled tokens
    = prompt - cached, as bench/demo.py measures; ``recomputed_tokens``: prompt work redone
    after preemptions (not in prefilled).
    """

    requests: int = 0
    finished: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    recomputed_tokens: int = 0
    preemptions: int = 0
    steps: int = 0
    busy_s: float = 0.0

    @property
    def prefilled_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens
