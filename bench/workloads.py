"""Seeded synthetic RL rollout traffic, as token IDs (pure: no I/O).

- GRPO: ``num_prompts`` prompts of about ``prompt_tokens`` tokens, each sampled ``group_size``
  times as concurrent requests sharing a ``group_id`` (seed 003, "Groups").
- Multi-turn agent sessions: turn k's prompt is turn k-1's prompt + the model's reply + an
  observation of about ``observation_tokens`` tokens (seed 003, "Turns").
"""

from __future__ import annotations

import random
from dataclasses import dataclass

FIRST_ORDINARY_TOKEN = 8
"""Token IDs below this are special tokens of the tiny model (BOS, EOS, PAD, chat markers)."""


@dataclass(frozen=True)
class GrpoWorkload:
    """GRPO group sampling: ``num_prompts`` groups of ``group_size`` concurrent samples,
    ``concurrent_groups`` groups in flight at once (as a trainer sends a step's groups)."""

    num_prompts: int = 4
    """GRPO groups (prompts) in the run."""
    prompt_tokens: int = 2000
    """Tokens of each group's prompt (random token IDs)."""
    group_size: int = 16
    """Samples per prompt, sent at once (the group's members)."""
    max_tokens: int = 8
    """Tokens each sample generates."""
    concurrent_groups: int = 2
    """Groups in flight at once."""
    seed: int = 0
    """Seed of the prompts' tokens."""


@dataclass(frozen=True)
class AgentWorkload:
    """Multi-turn sessions: ``num_sessions`` run concurrently, each ``turns`` turns long."""

    num_sessions: int = 4
    """Agent sessions running at once."""
    turns: int = 6
    """Turns per session; turn k+1's prompt is turn k's prompt + its reply + an observation."""
    first_prompt_tokens: int = 1000
    """Tokens of each session's first prompt."""
    observation_tokens: int = 480
    """Tokens of the tool observation appended after each reply."""
    reply_tokens: int = 32
    """Tokens each turn generates."""
    seed: int = 1
    """Seed of the sessions' tokens."""


def random_tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    """``n`` ordinary token IDs in ``[FIRST_ORDINARY_TOKEN, vocab_size)``."""
    if vocab_size <= FIRST_ORDINARY_TOKEN:
        raise ValueError(f"vocab_size must exceed {FIRST_ORDINARY_TOKEN}, got {vocab_size}")
    return [rng.randrange(FIRST_ORDINARY_TOKEN, vocab_size) for _ in range(n)]


def grpo_prompts(w: GrpoWorkload, vocab_size: int) -> list[list[int]]:
    """One prompt per group; lengths jittered by up to 5% so groups differ in block counts."""
    rng = random.Random(w.seed)
    return [random_tokens(rng, int(w.prompt_tokens * rng.uniform(0.95, 1.0)), vocab_size)
            for _ in range(w.num_prompts)]


def agent_first_prompts(w: AgentWorkload, vocab_size: int) -> list[list[int]]:
    """The first-turn prompt of each session."""
    rng = random.Random(w.seed)
    return [random_tokens(rng, w.first_prompt_tokens, vocab_size) for _ in range(w.num_sessions)]


def agent_observation(w: AgentWorkload, session: int, turn: int, vocab_size: int) -> list[int]:
    """The observation appended after turn ``turn`` of ``session`` (deterministic per pair)."""
    rng = random.Random(hash((w.seed, session, turn)) & 0xFFFFFFFF)
    return random_tokens(rng, w.observation_tokens, vocab_size)
