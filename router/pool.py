"""The router's view of its replicas: endpoints, health, in-flight load, last scrape.

Invariant: ``in_flight[r]`` counts requests this router dispatched to replica ``r`` and has
not yet released; it is incremented at dispatch (not at the first streamed byte) and
decremented exactly once per request, on completion, error or disconnect.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from cache_policy.types import ReplicaId, ReplicaView
from replicas.metrics import VllmMetrics
from replicas.replica_set import ReplicaEndpoint


@dataclass
class ReplicaState:
    """Mutable state of one replica, owned by the `ReplicaPool`."""

    endpoint: ReplicaEndpoint
    healthy: bool = True
    in_flight: int = 0
    metrics: VllmMetrics = field(default_factory=VllmMetrics)
    weight_version: int | None = None
    scrape_failures: int = 0
    """Consecutive failed metrics scrapes (reset by a good one)."""

    def view(self) -> ReplicaView:
        m = self.metrics
        return ReplicaView(
            replica_id=self.endpoint.replica_id,
            healthy=self.healthy,
            in_flight=self.in_flight,
            kv_cache_usage=m.kv_cache_usage,
            num_running=m.num_running,
            num_waiting=m.num_waiting,
            num_gpu_blocks=m.num_gpu_blocks or self.endpoint.num_gpu_blocks,
            block_size=self.endpoint.block_size,
            scoring_cap=self.endpoint.scoring_cap,
            weight_version=self.weight_version,
        )


class ReplicaPool:
    """All replicas behind one router. Not thread-safe: used from the event loop only."""

    def __init__(self, endpoints: Sequence[ReplicaEndpoint]):
        if not endpoints:
            raise ValueError("the router needs at least one replica endpoint")
        self._states: dict[ReplicaId, ReplicaState] = {}
        self.set_endpoints(endpoints)

    def set_endpoints(self, endpoints: Sequence[ReplicaEndpoint]) -> None:
        """Replace the endpoint list, keeping load counters of replicas that stay."""
        old = self._states
        self._states = {}
        for ep in endpoints:
            state = old.get(ep.replica_id)
            self._states[ep.replica_id] = ReplicaState(ep) if state is None else dataclasses.replace(state, endpoint=ep)

    @property
    def block_size(self) -> int:
        sizes = {s.endpoint.block_size for s in self._states.values()}
        if len(sizes) != 1:
            raise ValueError(f"replicas disagree on block_size: {sorted(sizes)}; configure one block size")
        return sizes.pop()

    @property
    def model(self) -> str:
        return next(iter(self._states.values())).endpoint.model

    def ids(self) -> list[ReplicaId]:
        return list(self._states)

    def get(self, replica_id: ReplicaId) -> ReplicaState:
        return self._states[replica_id]

    def states(self) -> Iterable[ReplicaState]:
        return self._states.values()

    def views(self, exclude: Iterable[ReplicaId] = ()) -> list[ReplicaView]:
        skip = set(exclude)
        return [s.view() for rid, s in self._states.items() if rid not in skip]

    def acquire(self, replica_id: ReplicaId) -> None:
        self._states[replica_id].in_flight += 1

    def release(self, replica_id: ReplicaId) -> None:
        state = self._states.get(replica_id)
        if state is None:  # replica removed while the request ran
            return
        assert state.in_flight > 0, f"bug: release without acquire on {replica_id}"
        state.in_flight -= 1
