"""Block hashes of simulated sequences, computed once per (sequence, salt).

The engine model needs the chained hashes of each request's prompt and output tokens, as
vLLM computes them (``cache_policy.hashing``: salt folded into block 0). Sessions grow turn
by turn and a GRPO group's 16 samples share one prompt, so hashes are memoised per
``(key, salt)`` with an incremental ``BlockHasher``: a sequence registered under a key must
extend the tokens previously hashed under that key (the workload guarantees it).

Output tokens that the workload leaves unspecified (a GRPO sample's random completion, never
reused) get *synthetic* unique hashes at or above ``2**64``, so those blocks are still cached
and ordered in the LRU queue like vLLM's, but never collide with a real xxh3_64 hash.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from cache_policy.hashing import BlockHasher

_SYNTHETIC_BASE = 1 << 64


class SequenceHashes:
    """Memo of ``BlockHasher`` per ``(key, salt)``; ``forget(key)`` when a session ends."""

    def __init__(self, block_size: int, *, seed: int = 0) -> None:
        self.block_size = block_size
        self.seed = seed
        self._hashers: dict[str, dict[str | None, BlockHasher]] = {}
        self._unique = itertools.count(_SYNTHETIC_BASE)

    def hashes(self, key: str, salt: str | None, tokens: Sequence[int]) -> tuple[int, ...]:
        """Hashes of the full blocks of ``tokens`` (which extend what ``key`` saw before)."""
        by_salt = self._hashers.setdefault(key, {})
        hasher = by_salt.get(salt)
        if hasher is None or hasher.num_tokens > len(tokens):
            hasher = BlockHasher(self.block_size, salt, seed=self.seed)
            by_salt[salt] = hasher
        if hasher.num_tokens < len(tokens):
            hasher.extend(tokens[hasher.num_tokens:])
        return hasher.hashes[: len(tokens) // self.block_size]

    def with_unique_tail(self, prompt_hashes: tuple[int, ...], prompt_tokens: int,
                         total_tokens: int) -> tuple[int, ...]:
        """``prompt_hashes`` (full prompt blocks) then synthetic hashes up to ``total_tokens``."""
        bs = self.block_size
        full = prompt_hashes[: prompt_tokens // bs]
        extra = total_tokens // bs - len(full)
        return full + tuple(next(self._unique) for _ in range(extra))

    def forget(self, key: str) -> None:
        """Drop the memo for ``key`` under every salt."""
        self._hashers.pop(key, None)

    def __len__(self) -> int:
        return len(self._hashers)
