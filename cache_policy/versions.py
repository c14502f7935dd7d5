"""VersionBook: weight versions the replicas serve and the cache salt each request runs under.

DESIGN rules 4 and 6, seed 003 ("The cache after a weight update"). The book holds::

    current    policy version of the last update (the initial version at start)
    policy     weight-update policy in force (flush | keep | salt | keep+salt)
    history    every version loaded so far; a request's ``weight_version`` resolves to the
               newest one <= it, so training steps without a weight change keep one salt
    loaded     per replica, the version it serves
    log        per replica, the versions loaded over time: what a request saw while it ran
               (the newest ``LOG_KEPT`` to ``2 * LOG_KEPT`` entries; marks are absolute)
    rotation   replicas kept out of routing, with the reason ("updating", "failed: <why>")
    cached     per replica, the versions whose KV its prefix cache may hold (since its last
               confirmed reset), ascending: what an unsalted request there may reuse

A router left running for days with an update every step (issue 15's soak, ``bench.soak``):
``history`` and ``cached`` keep one int per version loaded (since the last reset, for
``cached``), which is what the contract needs (a ``keep`` answer lists every version its KV may
come from); every per-request and per-update operation on them is a bisection, not a scan, so
a request costs the same on day seven as on day one. ``log`` is cut to its newest entries.

The version contract (DESIGN rule 6, README "Version contract"): a request whose salt names
version s is *strict* (``SaltChoice.pins_version``) unless it is a keep+salt session or group
continuing from an older start (also when tagged with that start). A strict request runs only
on a replica serving s; when no eligible replica does, the core re-salts it for a version one
serves (:meth:`VersionBook.choice_for`), so its tokens are computed by the weights whose KV it
reuses. Versions only grow on a replica, so the namespace of s on a replica serving s holds KV
computed by s alone. Scoring is strict under
every policy: it is salted by its own version even under ``keep`` (never under ``flush``, whose
caches are emptied at every update) and never inherits a session's start salt.

A session's or group's start version lives in its ``KeyRegistry`` record, kept while the key is
alive (in flight, or touched within ``PolicyConfig.key_ttl_s``), so a tool call longer than
``session_idle_s`` does not restart a keep+salt session on the new salt.

The salt comes from a loaded version, never from a step counter; a salted request is routed
only to replicas that serve the version its salt names (when one does), so blocks of one
version are never predicted, or computed, under another version's salt. A tenant, when given,
is folded into every salt (also under flush and keep), so tenants never share cache blocks.
"""

from __future__ import annotations

import bisect

import msgspec

from cache_policy.registry import KeyRegistry
from cache_policy.salts import WEIGHT_UPDATE_POLICIES, WeightUpdatePolicy, cache_salt_for_version, choose_salt
from cache_policy.types import ReplicaId

LOG_KEPT = 64
"""Entries of a replica's version log kept (cut back to this once it doubles). A request whose
mark fell off the kept part has seen at least ``LOG_KEPT`` updates since: it reads as moved
(:meth:`VersionBook.versions_since`), which it is."""


class SaltChoice(msgspec.Struct, frozen=True):
    """The salt of one request and the version its cache blocks belong to.

    ``version``: the loaded version the request resolves to (it is routed to replicas serving
    it when one does); ``salt_version``: the version named by ``salt`` (older than ``version``
    for a keep+salt session that started before an update); both None without versions.
    ``pins_version``: the request is *strict*: salted for its own version (``salt_version ==
    version``), so routed only to replicas serving it; never for a keep+salt session's or group's
    later turn on its start salt after an update (the allowed hybrid), even one tagged with the
    start version itself. A field, set by :class:`VersionBook`, not derived: the core reads it
    several times per request.
    """

    salt: str | None
    version: int | None
    salt_version: int | None
    pins_version: bool = False


NO_SALT = SaltChoice(None, None, None)


def tenant_salt(salt: str | None, tenant: str | None) -> str | None:
    """``salt`` with ``tenant`` folded in (``"<salt>|t=<tenant>"``); unchanged without a tenant."""
    if tenant is None:
        return salt
    return f"{salt or 'rr'}|t={tenant}"


class VersionBook:
    """Versions, salts and rotation of one router; pure, no clock of its own."""

    def __init__(self, policy: WeightUpdatePolicy, initial_version: int | None) -> None:
        check_policy(policy)
        self.policy: WeightUpdatePolicy = policy
        self.current = initial_version
        self.initial = initial_version
        self.history: list[int] = [] if initial_version is None else [initial_version]
        self.loaded: dict[ReplicaId, int | None] = {}
        """Each replica's loaded version (None: unknown); written by :meth:`set_loaded`,
        :meth:`forget_replica` and :meth:`forget_loaded` only (they keep ``_on_version``)."""
        self._on_version: dict[int | None, int] = {}
        """How many replicas of ``loaded`` serve each version: :meth:`excluded` skips its scan
        when every replica serves the request's version (at 1,024 replicas the scan was ~0.1 ms)."""
        self._log: dict[ReplicaId, list[int]] = {}
        self._log_base: dict[ReplicaId, int] = {}
        """Per replica, the absolute position of ``_log[rid][0]`` (entries before it were cut)."""
        self.rotation: dict[ReplicaId, str] = {}
        self._cached: dict[ReplicaId, list[int]] = {}
        """Per replica, ascending (bisected, never scanned: one entry per version since the reset)."""

    # -- salts --------------------------------------------------------------------------------

    def resolve(self, requested: int | None) -> int | None:
        """The loaded version a request tagged ``requested`` runs under: the newest version
        loaded so far that is <= ``requested`` (untagged: ``current``)."""
        if requested is None or not self.history:
            return self.current if requested is None else requested
        i = bisect.bisect_right(self.history, requested)
        return self.history[i - 1] if i else requested

    def assign(self, registry: KeyRegistry, session_id: str | None, group_id: str | None,
               requested: int | None, tenant: str | None = None, *, scoring: bool = False) -> SaltChoice:
        """Salt for one request; records the version a new session or group starts under.

        ``scoring``: a scoring request, salted by its own version under every policy but
        ``flush`` (scoring is never hybrid), whatever its session started under."""
        version = self.resolve(requested)
        started = None
        new_key = False
        if session_id is not None or group_id is not None:
            for kind, key in (("session", session_id), ("group", group_id)):
                if key is not None:
                    rec = registry.touch(kind, key)
                    if rec.start_version is None:
                        rec.start_version = version
                        new_key = new_key or started is None
                    started = rec.start_version if started is None else started
        if scoring:
            salt = None if self.policy == "flush" else cache_salt_for_version(version)
            return SaltChoice(tenant_salt(salt, tenant), version, None if salt is None else version, salt is not None)
        salt = choose_salt(self.policy, version, started, version)
        salt_version = None
        if salt is not None:
            salt_version = started if started is not None and salt == cache_salt_for_version(started) else version
        # a later turn on the start salt after an update, tagged with the start version itself
        # (RL clients tag every request with the version they sampled from): still the hybrid
        # keep+salt allows, not strict (strict would re-salt it and lose its cached prefix)
        continuing = (started is not None and not new_key and salt_version == started and self.policy == "keep+salt"
                      and self.current is not None and started < self.current)
        strict = salt_version is not None and salt_version == version and not continuing
        return SaltChoice(tenant_salt(salt, tenant), version, salt_version, strict)

    def choice_for(self, version: int, tenant: str | None) -> SaltChoice:
        """A strict choice for ``version`` (its salt, tenant folded in): a strict request
        re-salted because no eligible replica serves the version it was tagged for."""
        salt = cache_salt_for_version(version)
        return SaltChoice(tenant_salt(salt, tenant), version, version, True)

    def too_stale(self, requested: int | None, max_staleness: int | None) -> bool:
        """Whether a request tagged ``requested`` is older than ``current`` by more than
        ``max_staleness`` versions (the asynchronous-RL off-policyness bound; None: off)."""
        return (max_staleness is not None and requested is not None and self.current is not None
                and self.current - requested > max_staleness)

    def kv_versions(self, rid: ReplicaId, choice: SaltChoice) -> list[int]:
        """Versions whose weights computed the KV a request with ``choice`` may reuse on ``rid``,
        ascending, each once.

        Strict and salted: its salt's version alone. Salted, continuing a keep+salt key: its
        salt's version and every later version ``rid``'s cache has seen (hybrid blocks written
        into that namespace). Unsalted: every version ``rid``'s cache has seen since its last
        confirmed reset (``flush`` resets at each update, so one version)."""
        cached = self._cached.get(rid) or ([] if self.loaded.get(rid) is None else [self.loaded[rid]])
        if choice.salt_version is None:
            return list(cached)
        salt_version = choice.salt_version
        if choice.pins_version:
            return [salt_version]
        later = cached[bisect.bisect_left(cached, salt_version):]  # ascending: the versions >= the salt's
        return later if later and later[0] == salt_version else [salt_version, *later]

    def cache_reset(self, rid: ReplicaId) -> None:
        """``rid``'s prefix cache was emptied: from now on it holds KV of its loaded version only."""
        version = self.loaded.get(rid)
        self._cached[rid] = [] if version is None else [version]

    # -- loaded versions and the per-replica log ------------------------------------------------

    def set_loaded(self, rid: ReplicaId, version: int | None) -> None:
        """Record that ``rid`` now serves ``version`` (None: unknown)."""
        self._count_out(rid)
        self.loaded[rid] = version
        self._on_version[version] = self._on_version.get(version, 0) + 1
        log = self._log.setdefault(rid, [])
        if version is not None and (not log or log[-1] != version):
            log.append(version)
            if len(log) > 2 * LOG_KEPT:
                cut = len(log) - LOG_KEPT
                del log[:cut]
                self._log_base[rid] = self._log_base.get(rid, 0) + cut
            _insert_sorted(self._cached.setdefault(rid, []), version)
            _insert_sorted(self.history, version)

    def mark(self, rid: ReplicaId) -> int:
        """A position in ``rid``'s version log (absolute: it survives the log being cut); pass it
        to :meth:`versions_since`."""
        return self._log_base.get(rid, 0) + max(0, len(self._log.get(rid, ())) - 1)

    def versions_since(self, rid: ReplicaId, mark: int) -> list[int]:
        """Versions ``rid`` served from ``mark`` until now (more than one: mixed tokens). A mark
        older than the kept log (:data:`LOG_KEPT` updates ago and more) gets every kept entry,
        all of them loaded after it: more than one, as the whole log would say."""
        return list(self._log.get(rid, ())[max(0, mark - self._log_base.get(rid, 0)):])

    def finish_update(self, version: int, policy: WeightUpdatePolicy) -> None:
        """An update to ``version`` under ``policy`` reached at least one replica."""
        check_policy(policy)
        self.current = version if self.current is None else max(self.current, version)
        self.policy = policy
        _insert_sorted(self.history, version)

    def forget_replica(self, rid: ReplicaId) -> None:
        """``rid`` left the fleet."""
        self._count_out(rid)
        self.loaded.pop(rid, None)
        self._log.pop(rid, None)
        self._log_base.pop(rid, None)
        self._cached.pop(rid, None)
        self.rotation.pop(rid, None)

    def forget_loaded(self) -> None:
        """Every replica's version is unknown from now on (``cache_policy.sharing.unconfirmed``)."""
        for rid in self.loaded:
            self.loaded[rid] = None
        self._on_version = {None: len(self.loaded)} if self.loaded else {}

    def _count_out(self, rid: ReplicaId) -> None:
        if rid in self.loaded:
            old = self.loaded[rid]
            left = self._on_version[old] - 1
            if left:
                self._on_version[old] = left
            else:
                del self._on_version[old]

    def sizes(self) -> dict[str, int]:
        """Entries held: ``history`` (one per version loaded), ``cached_versions`` (per replica,
        one per version since its last reset) and ``version_log`` (at most ``2 * LOG_KEPT`` per
        replica)."""
        return {"history": len(self.history), "cached_versions": sum(map(len, self._cached.values())),
                "version_log": sum(map(len, self._log.values()))}

    def check_integrity(self) -> None:
        """Raise ``RuntimeError('bug: ...')`` if the per-version counts disagree with ``loaded``, or
        ``history`` or a replica's cached versions are not strictly ascending (they are bisected),
        or a version log outgrew its bound."""
        counts: dict[int | None, int] = {}
        for version in self.loaded.values():
            counts[version] = counts.get(version, 0) + 1
        if counts != self._on_version:
            raise RuntimeError(f"bug: replicas per version {self._on_version} != {counts} in loaded")
        for name, versions in (("history", self.history), *((f"cached of {r}", c) for r, c in self._cached.items())):
            if any(a >= b for a, b in zip(versions, versions[1:])):
                raise RuntimeError(f"bug: {name} is not strictly ascending: {versions}")
        for rid, log in self._log.items():
            if len(log) > 2 * LOG_KEPT:
                raise RuntimeError(f"bug: the version log of {rid} holds {len(log)} entries (at most {2 * LOG_KEPT})")

    # -- rotation -----------------------------------------------------------------------------

    def excluded(self, choice: SaltChoice) -> set[ReplicaId]:
        """Replicas a request with ``choice`` must not be routed to.

        Out of rotation always; and, for a strict request (``choice.pins_version``), every
        replica not serving its version, even when none does (the core then re-salts it:
        ``DecisionCore.place``)."""
        out = set(self.rotation)
        if choice.pins_version and self._on_version.get(choice.version, 0) != len(self.loaded):
            out |= {r for r, v in self.loaded.items() if v != choice.version}
        return out

    def allows(self, rid: ReplicaId, choice: SaltChoice) -> bool:
        """Whether ``rid`` is not in :meth:`excluded` for ``choice``, without building that set
        (``DecisionCore._move_queued`` asks it for every queued job)."""
        if rid in self.rotation:
            return False
        return (not choice.pins_version or self._on_version.get(choice.version, 0) == len(self.loaded)
                or rid not in self.loaded or self.loaded[rid] == choice.version)

    def updating(self) -> bool:
        """Whether some replica is out of rotation for an update in progress."""
        return any(reason == "updating" for reason in self.rotation.values())

    def describe(self) -> dict:
        """The state as JSON for ``GET /admin/weights`` and ``/health``."""
        return {
            "current_version": self.current, "policy": self.policy, "history": list(self.history),
            "replicas": {rid: {"weight_version": v, "in_rotation": rid not in self.rotation,
                               "out_of_rotation_reason": self.rotation.get(rid)}
                         for rid, v in self.loaded.items()},
        }


def _insert_sorted(versions: list[int], version: int) -> None:
    """Add ``version`` to the ascending ``versions`` unless it is there (a bisection, not a scan)."""
    i = bisect.bisect_left(versions, version)
    if i == len(versions) or versions[i] != version:
        versions.insert(i, version)


def check_policy(policy: str) -> None:
    """ValueError naming ``weight_update_policy`` unless ``policy`` is one of the four."""
    if policy not in WEIGHT_UPDATE_POLICIES:
        raise ValueError(f"weight_update_policy must be one of {WEIGHT_UPDATE_POLICIES}, got {policy!r}")
