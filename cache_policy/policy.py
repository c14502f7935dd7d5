"""The Policy interface and the registry of policies by name.

Modelled on SGLang's ``LoadBalancingPolicy`` trait (``policies/mod.rs``): one small
interface, one policy per file, transport elsewhere. Policies are synchronous and
microsecond-scale; the router calls ``select``, dispatches, then ``on_routed``, and
``on_finished`` when the request ends (success, error or disconnect).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Protocol

from cache_policy.affinity import PrefixAffinityPolicy
from cache_policy.config import PolicyConfig
from cache_policy.least_load import LeastLoadPolicy
from cache_policy.registry import KeyRegistry
from cache_policy.round_robin import RoundRobinPolicy
from cache_policy.types import Decision, ReplicaId, ReplicaView, RequestView


class Policy(Protocol):
    """Chooses a replica for each request.

    ``select`` returns ``None`` when no replica is eligible (none healthy); that is an
    outcome, not an error. It raises ``ValueError`` only on a caller mistake (duplicate
    replica ids). The hooks may do nothing.
    """

    name: str

    def select(self, request: RequestView, replicas: Sequence[ReplicaView]) -> Decision | None: ...

    def on_routed(self, request: RequestView, decision: Decision) -> None: ...

    def on_finished(self, request: RequestView, replica_id: ReplicaId) -> None: ...

    def on_rejected(self, request: RequestView, decision: Decision) -> None: ...

    def on_replicas_changed(self, replica_ids: Sequence[ReplicaId]) -> None: ...

    def on_cache_reset(self, replica_id: ReplicaId) -> None: ...

    def on_service(self, replica_id: ReplicaId, in_service: bool) -> None: ...

    def check_integrity(self) -> None: ...


PolicyFactory = Callable[..., Policy]

POLICIES: dict[str, PolicyFactory] = {
    PrefixAffinityPolicy.name: PrefixAffinityPolicy,
    RoundRobinPolicy.name: RoundRobinPolicy,
    LeastLoadPolicy.name: LeastLoadPolicy,
}
"""Registered policies by name: ``prefix_affinity``, ``round_robin``, ``least_load``."""


def make_policy(name: str, cfg: PolicyConfig, rng: random.Random, pins: KeyRegistry | None = None) -> Policy:
    """Build the policy called ``name``; ValueError listing the valid names otherwise.

    ``pins``: the core's key registry, for policies that pin sessions and groups (else their own)."""
    try:
        factory = POLICIES[name]
    except KeyError as exc:
        valid = ", ".join(sorted(POLICIES))
        raise ValueError(f"unknown policy {name!r}; valid policy names: {valid}") from exc
    return factory(cfg, rng, pins=pins) if factory is PrefixAffinityPolicy else factory(cfg, rng)
