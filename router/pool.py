"""The router's address book of its replicas: endpoints and the transport-side scrape state.

Decisions about a replica (health, load, version, rotation) live in the decision core
(``cache_policy.core``); this pool only knows how to reach each replica and what its last
``/metrics`` scrape said, and feeds both to the core (``router.scrape``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from cache_policy.types import ReplicaId
from replicas.metrics import VllmMetrics
from replicas.replica_set import ReplicaEndpoint


@dataclass
class ReplicaState:
    """How to reach one replica and its last scrape, owned by the `ReplicaPool`."""

    endpoint: ReplicaEndpoint
    metrics: VllmMetrics = field(default_factory=VllmMetrics)
    scrape_failures: int = 0
    """Consecutive failed metrics scrapes (reset by a good one)."""
    silent: bool = False
    """Its last scrape got no answer in time, or showed its engine stalled
    (``DecisionCore.stalled``): hung, not one that answered an error. Its requests in flight are
    taken back when it leaves rotation so (``router.app._scrape_loop``)."""
    went_silent: bool = False
    """A scrape took it out of rotation as silent (it was healthy before): the scrape loop takes
    its requests in flight back, once, whichever round that scrape finished in."""
    gone: bool = False
    """A scrape or request was refused since its last answered scrape (``ECONNREFUSED``: nothing
    listened on its port, so the server process that answered before is gone)."""
    process_start_s: float = 0.0
    """Its server process's start time at its last answered scrape (``VllmMetrics.process_start_s``;
    0: not known)."""
    restarted: bool = False
    """A scrape found a new server process behind its URL (another process start time, an answer
    after :attr:`gone`, or token counters that went back): unhealthy until the scrape loop takes
    it as the restart it is (``router.fleet.server_restarted``), once, whichever round that
    scrape finished in."""


class ReplicaPool:
    """All replicas behind one router. Not thread-safe: used from the event loop only."""

    def __init__(self, endpoints: Sequence[ReplicaEndpoint]):
        if not endpoints:
            raise ValueError("the router needs at least one replica endpoint")
        self._states: dict[ReplicaId, ReplicaState] = {}
        self.set_endpoints(endpoints)

    def set_endpoints(self, endpoints: Sequence[ReplicaEndpoint]) -> None:
        """Replace the endpoint list, keeping the scrape state of replicas that stay."""
        old = self._states
        self._states = {}
        if endpoints:
            self._model = endpoints[0].model
        for ep in endpoints:
            state = old.get(ep.replica_id)
            self._states[ep.replica_id] = ReplicaState(ep) if state is None else dataclasses.replace(state, endpoint=ep)

    @property
    def model(self) -> str:
        """The model the replicas serve; once the last one left, the one they served (every
        replica serves one model: ``/admin/replicas`` refuses another)."""
        return self._model

    def ids(self) -> list[ReplicaId]:
        return list(self._states)

    def get(self, replica_id: ReplicaId) -> ReplicaState:
        return self._states[replica_id]

    def __contains__(self, replica_id: object) -> bool:
        return replica_id in self._states

    def states(self) -> Iterable[ReplicaState]:
        return self._states.values()
