"""Types that cross package boundaries (router <-> cache_policy <-> replicas).

All are frozen: a view is a snapshot taken by the I/O shell; a decision is what the
policy returns for the shell to carry out.
"""

from __future__ import annotations

import enum
from typing import Literal, NewType

import msgspec

BlockHash = NewType("BlockHash", int)
"""Chained 64-bit xxhash of one full token block (see `cache_policy.hashing`)."""

ReplicaId = NewType("ReplicaId", str)
"""Stable name of one vLLM replica, e.g. ``"replica-0"``."""

RequestKind = Literal["generate", "score"]


class RequestView(msgspec.Struct, frozen=True):
    """What the policy needs to know about one request.

    ``block_hashes`` are the chained hashes of the prompt's *full* blocks (salt folded into
    block 0), in order; ``num_prompt_tokens`` counts every prompt token, including the
    partial last block.
    """

    block_hashes: tuple[BlockHash, ...]
    num_prompt_tokens: int
    session_id: str | None = None
    group_id: str | None = None
    kind: RequestKind = "generate"
    weight_version: int | None = None
    fan_out: int = 1
    """Engine requests it stands for (a scoring fan-out's K), in load and pin counts alike."""

    def __post_init__(self) -> None:
        assert self.num_prompt_tokens >= 0, self.num_prompt_tokens
        assert self.fan_out >= 1, self.fan_out


class ReplicaView(msgspec.Struct, frozen=True):
    """A snapshot of one replica as the router sees it.

    ``in_flight`` is the router's own count of requests dispatched and not yet finished
    (counted at dispatch, released on completion, error or disconnect). The KV fields come
    from the replica's ``/metrics`` scrape (``vllm:kv_cache_usage_perc`` in [0, 1],
    ``vllm:num_requests_running`` / ``..._waiting``); ``num_gpu_blocks`` is its KV cache
    size in blocks (0 when unknown).
    """

    replica_id: ReplicaId
    healthy: bool = True
    in_flight: int = 0
    kv_cache_usage: float = 0.0
    num_running: int = 0
    num_waiting: int = 0
    num_gpu_blocks: int = 0
    block_size: int = 32
    scoring_cap: bool = False
    weight_version: int | None = None
    queued: int = 0
    """Engine requests placed on the replica that wait in this router's admission queue (a
    fan-out counts K): work committed to it that neither ``in_flight`` nor ``num_waiting`` shows."""


class RouteReason(str, enum.Enum):
    """Why a replica was chosen; exported as a Prometheus label."""

    SESSION = "session"  # the session's pinned replica
    GROUP = "group"  # the GRPO group's pinned replica
    PREFIX = "prefix"  # longest cached prefix (from the prefix index)
    LOAD = "load"  # cache miss, least loaded
    BALANCE = "balance"  # balance guard overrode affinity
    REPIN = "repin"  # pin moved: pinned replica unhealthy, or staying cost more (move_rule)
    ROUND_ROBIN = "round_robin"


class Decision(msgspec.Struct, frozen=True):
    """Where one request goes and what the router expects to be cached there.

    ``matched_blocks`` is the number of leading ``block_hashes`` the prefix index believes
    the chosen replica holds; expected cached tokens = ``matched_blocks * block_size``.
    """

    replica_id: ReplicaId
    reason: RouteReason
    matched_blocks: int = 0
    extra: dict[str, str] = msgspec.field(default_factory=dict)
