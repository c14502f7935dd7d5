"""RoundRobinPolicy: cycle over the healthy replicas, ignoring cache and load.

A baseline for benchmarks; keeps no per-request state.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from cache_policy.config import PolicyConfig
from cache_policy.selection import NoopHooks, healthy
from cache_policy.types import Decision, ReplicaId, ReplicaView, RequestView, RouteReason


class RoundRobinPolicy(NoopHooks):
    """Send each request to the healthy replica after the previous choice.

    "After" is in the order of the ``replicas`` sequence the router passes; when the
    previous choice is no longer healthy or present, the cycle restarts at the first
    healthy replica. Reason: ``ROUND_ROBIN``.
    """

    name = "round_robin"

    def __init__(self, cfg: PolicyConfig, rng: random.Random) -> None:
        self.cfg = cfg
        self.rng = rng
        self._last: ReplicaId | None = None

    def select(self, request: RequestView, replicas: Sequence[ReplicaView]) -> Decision | None:
        """The next healthy replica in cycle order; ``None`` when none is healthy."""
        ids = [r.replica_id for r in healthy(replicas)]
        if not ids:
            return None
        nxt = ids[(ids.index(self._last) + 1) % len(ids)] if self._last in ids else ids[0]
        self._last = nxt
        return Decision(replica_id=nxt, reason=RouteReason.ROUND_ROBIN)
