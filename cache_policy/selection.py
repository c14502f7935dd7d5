"""Helpers shared by the policies: health filter, load, seeded tie-breaking, no-op hooks.

Ties are always broken by the injected ``random.Random`` over candidates kept in the
caller's replica order, never by position alone, so that a fixed seed reproduces a run.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from cache_policy.types import Decision, ReplicaId, ReplicaView, RequestView


def healthy(replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
    """The healthy replicas, in the given order; ValueError on a duplicate replica id."""
    if len({r.replica_id for r in replicas}) != len(replicas):
        raise ValueError(f"replicas must have distinct replica_id values, got {[r.replica_id for r in replicas]}")
    return [r for r in replicas if r.healthy]


def load(replica: ReplicaView) -> int:
    """Load of one replica, in requests: the router's in-flight count, the requests this
    router holds in its admission queue for it, and the replica's own waiting queue
    (``vllm:num_requests_waiting``, which also sees other clients).

    The admission queue counts (issue 15): without it a replica whose work waits in the
    router looks idle, and new keys pile onto it (at 64 replicas, ws/kv = 2: 4 replicas got
    3-6x the mean prefill)."""
    return replica.in_flight + replica.queued + replica.num_waiting


def pick_min(
    candidates: Sequence[ReplicaView],
    key: Callable[[ReplicaView], Any],
    rng: random.Random,
) -> ReplicaView:
    """The candidate with the smallest ``key``; ties broken by ``rng``."""
    assert candidates, "bug: pick_min on no candidates"
    return _first_of_min(candidates, [key(c) for c in candidates], rng)


def _first_of_min(candidates: Sequence[ReplicaView], keys: list[Any], rng: random.Random) -> ReplicaView:
    """The candidate whose key (``keys[i]`` is ``candidates[i]``'s) is smallest; ties by ``rng``."""
    best = min(keys)
    tied = [c for c, k in zip(candidates, keys) if k == best]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


def least_loaded(candidates: Sequence[ReplicaView], rng: random.Random,
                 sent: Mapping[ReplicaId, float] | None = None, scale: float = 1.0) -> ReplicaView:
    """The candidate with the least :func:`load`, or with ``sent`` the least ``load + sent``:
    ``scale * sent[r]`` is the engine requests placed on ``r`` lately (``cache_policy.sent``:
    stored values and the factor that decays them to now); ties by ``rng``. The keys are built
    inline, not by a function per candidate: this is the candidate scan of every new key
    (``bench.decision_cost`` at N = 1,024)."""
    assert candidates, "bug: least_loaded on no candidates"
    if sent is None:
        return pick_min(candidates, load, rng)
    get = sent.get
    return _first_of_min(candidates, [c.in_flight + c.queued + c.num_waiting + scale * get(c.replica_id, 0.0)
                                      for c in candidates], rng)  # load(c) + sent


def longest_prefix(
    candidates: Sequence[ReplicaView],
    matched: Mapping[ReplicaId, int],
    rng: random.Random,
) -> ReplicaView:
    """The candidate holding the most leading blocks; ties -> least loaded -> ``rng``."""
    assert candidates, "bug: longest_prefix on no candidates"
    if not matched:  # none holds a block: the least loaded, the same ties as the key below
        return pick_min(candidates, load, rng)
    get = matched.get
    return _first_of_min(candidates, [(-get(c.replica_id, 0), c.in_flight + c.queued + c.num_waiting)
                                      for c in candidates], rng)  # (-matched, load(c))


class NoopHooks:
    """The policy hooks, doing nothing; stateless policies inherit them."""

    def on_routed(self, request: RequestView, decision: Decision) -> None:
        """Called once the router has dispatched ``request`` as ``decision`` says."""

    def on_finished(self, request: RequestView, replica_id: ReplicaId) -> None:
        """Called when ``request`` ended on ``replica_id`` (success, error or disconnect)."""

    def on_rejected(self, request: RequestView, decision: Decision) -> None:
        """Called when ``request`` prefilled nothing on ``decision``'s replica (refused with a 4xx,
        the replica down or unreachable, or its client gone while it waited): undo its placement."""

    def on_replicas_changed(self, replica_ids: Sequence[ReplicaId]) -> None:
        """Called with the full current set of replica ids when it changes."""

    def on_cache_reset(self, replica_id: ReplicaId) -> None:
        """Called when ``replica_id``'s prefix cache was emptied."""

    def on_service(self, replica_id: ReplicaId, in_service: bool) -> None:
        """Called when ``replica_id`` went out of service (unhealthy or out of rotation) or came back."""

    def check_integrity(self) -> None:
        """Stateless: nothing can be corrupt."""
