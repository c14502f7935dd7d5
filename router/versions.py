"""Weight versions the replicas serve, and the cache salt each request runs under (DESIGN rule 4).

The router's state (``WeightVersions``)::

    current    policy version of the last update (router.initial_weight_version at start)
    policy     weight-update policy in force: router.weight_update_policy, then each update's
    loaded     per replica, the version it serves (ReplicaState.weight_version in the pool)
    history    every version loaded so far; a request's ``weight_version`` resolves to the
               newest one <= it, so training steps without a weight change keep one salt
    starts     session / group -> version it started under (keep+salt), LRU, idle ones expire
    log        per replica, the versions loaded over time: what a request saw while it ran
    rotation   replicas kept out of routing: "updating", or "failed: <why>"

The salt comes from a loaded version, never from a step counter, and a salted request is
routed only to replicas that serve the version its salt names (when one does), so blocks of
one version are never predicted, or computed, under another version's salt.
"""

from __future__ import annotations

import asyncio
import bisect
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from cache_policy.config import PolicyConfig
from cache_policy.salts import (
    WEIGHT_UPDATE_POLICIES,
    WeightUpdatePolicy,
    cache_salt_for_version,
    choose_salt,
)
from cache_policy.types import ReplicaId
from router.parse import RoutingKeys
from router.pool import ReplicaPool


@dataclass(frozen=True)
class SaltChoice:
    """The salt of one request and the version its cache blocks belong to.

    ``version``: the loaded version the request resolves to (it is routed to replicas serving
    it when one does); ``salt_version``: the version named by ``salt`` (older than ``version``
    for a keep+salt session that started before an update); both None without versions.
    """

    salt: str | None
    version: int | None
    salt_version: int | None

    @property
    def pins_version(self) -> bool:
        """Whether routing must prefer replicas that serve ``version`` (salted, own version)."""
        return self.salt is not None and self.salt_version == self.version


NO_SALT = SaltChoice(None, None, None)


class WeightVersions:
    """Versions, salts and rotation of one router. Event-loop only; the clock is passed in."""

    def __init__(self, pool: ReplicaPool, policy: WeightUpdatePolicy, initial_version: int | None,
                 cfg: PolicyConfig) -> None:
        _check_policy(policy)
        self.pool = pool
        self.policy: WeightUpdatePolicy = policy
        self.current = initial_version
        self.history: list[int] = [] if initial_version is None else [initial_version]
        self.idle_s = cfg.session_idle_s
        self.max_starts = cfg.max_pins
        self._starts: OrderedDict[tuple[str, str], tuple[int, float]] = OrderedDict()
        self._log: dict[ReplicaId, list[int]] = {}
        self.rotation: dict[ReplicaId, str] = {}
        self._rotation_changed = asyncio.Event()
        for rid in pool.ids():
            self.set_loaded(rid, initial_version)

    # -- salts ---------------------------------------------------------------------------

    def resolve(self, requested: int | None) -> int | None:
        """The loaded version a request tagged ``requested`` runs under: the newest version
        loaded so far that is <= ``requested`` (untagged: ``current``)."""
        if requested is None or not self.history:
            return self.current if requested is None else requested
        i = bisect.bisect_right(self.history, requested)
        return self.history[i - 1] if i else requested

    def assign(self, keys: RoutingKeys, now: float) -> SaltChoice:
        """Salt for one request; records the version a new session or group starts under."""
        version = self.resolve(keys.weight_version)
        started = self._started(keys, version, now)
        salt = choose_salt(self.policy, version, started, version)
        if salt is None:
            return SaltChoice(None, version, None)
        salt_version = started if salt == cache_salt_for_version(started) else version
        return SaltChoice(salt, version, salt_version)

    def _started(self, keys: RoutingKeys, version: int | None, now: float) -> int | None:
        """Version the request's session (else its group) started under; records first sight.

        A session or group unseen for longer than ``session_idle_s`` starts afresh.
        """
        found = None
        for key in (("session", keys.session_id), ("group", keys.group_id)):
            if key[1] is not None:
                start = self._touch_start(key, version, now)
                found = start if found is None else found
        while len(self._starts) > self.max_starts:
            self._starts.popitem(last=False)
        return found

    def _touch_start(self, key: tuple[str, str], version: int | None, now: float) -> int | None:
        entry = self._starts.get(key)
        start = entry[0] if entry is not None and now - entry[1] <= self.idle_s else version
        if start is not None:
            self._starts[key] = (start, now)
            self._starts.move_to_end(key)
        return start

    # -- loaded versions and the per-replica log --------------------------------------------

    def set_loaded(self, rid: ReplicaId, version: int | None) -> None:
        """Record that ``rid`` now serves ``version``."""
        self.pool.get(rid).weight_version = version
        log = self._log.setdefault(rid, [])
        if version is not None and (not log or log[-1] != version):
            log.append(version)
            if version not in self.history:
                bisect.insort(self.history, version)

    def loaded(self, rid: ReplicaId) -> int | None:
        return self.pool.get(rid).weight_version

    def mark(self, rid: ReplicaId) -> int:
        """A position in ``rid``'s version log; pass it to :meth:`versions_since`."""
        return max(0, len(self._log.get(rid, [])) - 1)

    def versions_since(self, rid: ReplicaId, mark: int) -> list[int]:
        """Versions ``rid`` served from ``mark`` until now (more than one: mixed tokens)."""
        return list(self._log.get(rid, [])[mark:])

    def finish_update(self, version: int, policy: WeightUpdatePolicy) -> None:
        """An update to ``version`` under ``policy`` reached at least one replica."""
        _check_policy(policy)
        self.current = version if self.current is None else max(self.current, version)
        self.policy = policy
        if version not in self.history:
            bisect.insort(self.history, version)

    # -- rotation ---------------------------------------------------------------------------

    def excluded(self, choice: SaltChoice) -> list[ReplicaId]:
        """Replicas a request with ``choice`` must not be routed to.

        Out of rotation always; and, for a salted request, replicas not serving its version
        while some replica in rotation does.
        """
        out = set(self.rotation)
        if choice.pins_version:
            serving = [s.endpoint.replica_id for s in self.pool.states()
                       if s.healthy and s.endpoint.replica_id not in out and s.weight_version == choice.version]
            if serving:
                out |= {rid for rid in self.pool.ids() if rid not in serving}
        return sorted(out)

    def take_out(self, rids: Iterable[ReplicaId], reason: str) -> None:
        for rid in rids:
            self.rotation[rid] = reason
        self._rotation_changed.set()

    def put_back(self, rid: ReplicaId) -> None:
        self.rotation.pop(rid, None)
        self._rotation_changed.set()

    async def wait_rotation(self, timeout_s: float) -> bool:
        """Wait until the rotation changes (an update step ended); False on timeout."""
        self._rotation_changed.clear()
        try:
            await asyncio.wait_for(self._rotation_changed.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True

    def updating(self) -> bool:
        return any(reason == "updating" for reason in self.rotation.values())

    def describe(self) -> dict:
        """The state as JSON for ``GET /admin/weights`` and ``/health``."""
        return {
            "current_version": self.current, "policy": self.policy, "history": list(self.history),
            "replicas": {s.endpoint.replica_id: {"weight_version": s.weight_version,
                                                  "in_rotation": s.endpoint.replica_id not in self.rotation,
                                                  "out_of_rotation_reason": self.rotation.get(s.endpoint.replica_id)}
                         for s in self.pool.states()},
        }


def _check_policy(policy: str) -> None:
    if policy not in WEIGHT_UPDATE_POLICIES:
        raise ValueError(f"weight_update_policy must be one of {WEIGHT_UPDATE_POLICIES}, got {policy!r}")
