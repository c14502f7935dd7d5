"""Factories for cache_policy tests: replica snapshots, requests and a fake router fleet."""

from __future__ import annotations

from collections.abc import Sequence
from msgspec.structs import replace
from typing import Any

import pytest

from cache_policy.hashing import block_hashes
from cache_policy.policy import Policy
from cache_policy.types import BlockHash, Decision, ReplicaId, ReplicaView, RequestView

BLOCK = 32
"""Block size used by the policy tests (vLLM CPU needs a multiple of 32)."""


def make_request(tokens: Sequence[int], **kw: Any) -> RequestView:
    """A request for prompt ``tokens``, hashed with 32-token blocks."""
    return RequestView(
        block_hashes=tuple(block_hashes(tokens, BLOCK)), num_prompt_tokens=len(tokens), **kw
    )


def hashes_request(hashes: Sequence[int], **kw: Any) -> RequestView:
    """A request made directly from block hash values."""
    return RequestView(
        block_hashes=tuple(BlockHash(h) for h in hashes),
        num_prompt_tokens=BLOCK * len(hashes),
        **kw,
    )


class Fleet:
    """Replica snapshots kept the way the router keeps them.

    ``route`` calls ``select`` then ``on_routed`` and counts the request in flight on the
    chosen replica; ``finish`` releases it and calls ``on_finished``.
    """

    def __init__(self, ids: Sequence[str], **kw: Any) -> None:
        self.views = {ReplicaId(i): ReplicaView(ReplicaId(i), **kw) for i in ids}

    def list(self) -> list[ReplicaView]:
        return list(self.views.values())

    def set(self, rid: str, **kw: Any) -> None:
        self.views[ReplicaId(rid)] = replace(self.views[ReplicaId(rid)], **kw)

    def in_flight(self, rid: str) -> int:
        return self.views[ReplicaId(rid)].in_flight

    def route(self, policy: Policy, request: RequestView) -> Decision:
        decision = policy.select(request, self.list())
        assert decision is not None
        policy.on_routed(request, decision)
        self.set(decision.replica_id, in_flight=self.in_flight(decision.replica_id) + 1)
        return decision

    def finish(self, policy: Policy, request: RequestView, rid: str) -> None:
        self.set(rid, in_flight=self.in_flight(rid) - 1)
        policy.on_finished(request, ReplicaId(rid))


@pytest.fixture
def fleet2() -> Fleet:
    """Two healthy idle replicas, ``a`` and ``b``."""
    return Fleet(["a", "b"])


@pytest.fixture
def fleet3() -> Fleet:
    """Three healthy idle replicas, ``a``, ``b`` and ``c``."""
    return Fleet(["a", "b", "c"])


@pytest.fixture
def new_fleet() -> type[Fleet]:
    """The ``Fleet`` class, to build fleets of any shape: ``new_fleet(["a", "b"], ...)``."""
    return Fleet


@pytest.fixture
def req() -> Any:
    """``req(tokens, **RequestView fields)``: a request for a token prompt."""
    return make_request


@pytest.fixture
def hreq() -> Any:
    """``hreq(hash values, **RequestView fields)``: a request from raw block hashes."""
    return hashes_request
