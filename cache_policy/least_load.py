"""LeastLoadPolicy: the healthy replica with the fewest requests, ignoring the cache."""

from __future__ import annotations

import random
from collections.abc import Sequence

from cache_policy.config import PolicyConfig
from cache_policy.selection import NoopHooks, healthy, least_loaded
from cache_policy.types import Decision, ReplicaView, RequestView, RouteReason


class LeastLoadPolicy(NoopHooks):
    """Send each request to the least loaded healthy replica.

    Load is ``in_flight + num_waiting`` (``cache_policy.selection.load``); ties are broken
    by the injected ``rng``. Reason: ``LOAD``. Keeps no state.
    """

    name = "least_load"

    def __init__(self, cfg: PolicyConfig, rng: random.Random) -> None:
        self.cfg = cfg
        self.rng = rng

    def select(self, request: RequestView, replicas: Sequence[ReplicaView]) -> Decision | None:
        """The least loaded healthy replica; ``None`` when none is healthy."""
        candidates = healthy(replicas)
        if not candidates:
            return None
        chosen = least_loaded(candidates, self.rng)
        return Decision(replica_id=chosen.replica_id, reason=RouteReason.LOAD)
