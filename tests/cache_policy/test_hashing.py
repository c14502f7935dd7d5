"""Block hashing: boundaries, chaining, salt in block 0, incremental == batch, errors."""

from __future__ import annotations

import random
import struct

import pytest
import xxhash

from cache_policy.hashing import BlockHasher, block_hashes

B = 32


def by_hand(parent: int, tokens: list[int], salt: str | None = None, seed: int = 0) -> int:
    """One chained block hash, recomputed from the documented byte layout."""
    data = struct.pack("<Q", parent) + b"".join(struct.pack("<I", t) for t in tokens)
    if salt is not None:
        data += b"\x01" + salt.encode()
    return xxhash.xxh3_64(data, seed=seed).intdigest()


TOKENS = list(range(1000, 1064))  # 64 tokens
H0 = by_hand(0, TOKENS[:32])
H1 = by_hand(H0, TOKENS[32:64])


@pytest.mark.parametrize(
    "n_tokens, expected",
    [(0, []), (31, []), (32, [H0]), (33, [H0]), (63, [H0]), (64, [H0, H1])],
)
def test_only_full_blocks_are_hashed(n_tokens: int, expected: list[int]) -> None:
    assert block_hashes(TOKENS[:n_tokens], B) == expected


def test_block_hash_chains_on_its_parent() -> None:
    other_head = [7] * 32 + TOKENS[32:64]
    hashes = block_hashes(other_head, B)
    assert hashes[1] == by_hand(by_hand(0, [7] * 32), TOKENS[32:64])
    assert hashes[1] != H1  # same block tokens, different prefix


def test_salt_is_folded_into_block_zero_only() -> None:
    salted = block_hashes(TOKENS, B, "rr:v3")
    s0 = by_hand(0, TOKENS[:32], "rr:v3")
    assert salted == [s0, by_hand(s0, TOKENS[32:64])]


def test_salt_changes_every_block_and_equal_prompts_share_all() -> None:
    plain = block_hashes(TOKENS, B)
    assert plain == block_hashes(list(TOKENS), B)
    salted = block_hashes(TOKENS, B, "rr:v1")
    assert all(p != s for p, s in zip(plain, salted, strict=True))
    assert salted == block_hashes(TOKENS, B, "rr:v1")
    assert block_hashes(TOKENS, B, "rr:v2")[1] != salted[1]


def test_seed_is_used() -> None:
    assert block_hashes(TOKENS, B, seed=7) == [
        by_hand(0, TOKENS[:32], seed=7),
        by_hand(by_hand(0, TOKENS[:32], seed=7), TOKENS[32:], seed=7),
    ]
    assert block_hashes(TOKENS, B, seed=7) != block_hashes(TOKENS, B, seed=0)


@pytest.mark.parametrize("salt", [None, "rr:v9"])
@pytest.mark.parametrize("seed", range(5))
def test_incremental_equals_batch(salt: str | None, seed: int) -> None:
    rng = random.Random(seed)
    tokens = [rng.randrange(50_000) for _ in range(rng.randrange(0, 400))]
    hasher = BlockHasher(B, salt, seed=seed)
    got: list[int] = []
    pos = 0
    while pos < len(tokens):
        step = rng.randrange(0, 70)
        new = hasher.extend(tokens[pos : pos + step])
        assert len(new) == (pos + step) // B - pos // B or pos + step > len(tokens)
        got += new
        pos += step
    assert got == block_hashes(tokens, B, salt, seed=seed)
    assert list(hasher.hashes) == got
    assert hasher.num_tokens == len(tokens)


def test_extend_returns_only_completed_blocks() -> None:
    hasher = BlockHasher(B)
    assert hasher.extend(TOKENS[:31]) == []
    assert hasher.extend(TOKENS[31:33]) == [H0]
    assert hasher.extend(TOKENS[33:64]) == [H1]
    assert hasher.extend([]) == []
    assert hasher.num_tokens == 64


@pytest.mark.parametrize("block_size", [0, -32])
def test_bad_block_size_is_a_value_error(block_size: int) -> None:
    with pytest.raises(ValueError, match="block_size"):
        block_hashes(TOKENS, block_size)
    with pytest.raises(ValueError, match="block_size"):
        BlockHasher(block_size)


@pytest.mark.parametrize("bad", [-1, 2**32])
def test_bad_token_id_is_a_value_error(bad: int) -> None:
    with pytest.raises(ValueError, match="token_ids"):
        block_hashes([*TOKENS[:40], bad], B)
    hasher = BlockHasher(B)
    hasher.extend(TOKENS[:10])
    with pytest.raises(ValueError, match="token_ids"):
        hasher.extend([bad])
    assert hasher.num_tokens == 10  # state unchanged by the failed call
    assert hasher.extend(TOKENS[10:32]) == [H0]


def test_empty_salt_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="cache_salt"):
        block_hashes(TOKENS, B, "")
