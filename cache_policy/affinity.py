"""PrefixAffinityPolicy: pins, then longest cached prefix, then least load (DESIGN rule 2).

The balance guard follows SGLang's cache-aware policy (``sgl-router/src/policies/
cache_aware.rs``): the system is imbalanced when ``max_load - min_load >
balance_abs_threshold`` and ``max_load > balance_rel_threshold * min_load``; then a
prefix-based choice goes to the least loaded replica instead. Differences from SGLang:
loads are taken over healthy replicas only, a cache miss goes to the least loaded replica
(not the one with the smallest tree), ties are broken by the injected ``rng``, and pins
(sessions, GRPO groups) come first and are not subject to the guard.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from cache_policy.config import PolicyConfig
from cache_policy.move_rule import move_target
from cache_policy.prefix_index import PrefixIndex
from cache_policy.registry import KeyRecord as Pin
from cache_policy.registry import KeyRegistry, PinKind
from cache_policy.selection import healthy, least_loaded, load, longest_prefix
from cache_policy.sent import RecentlySent
from cache_policy.types import Decision, ReplicaId, ReplicaView, RequestView, RouteReason

_PIN_ORDER: tuple[tuple[PinKind, RouteReason], ...] = (
    ("session", RouteReason.SESSION),
    ("group", RouteReason.GROUP),
)


class PrefixAffinityPolicy:
    """Route by session pin -> group pin -> longest prefix -> least load.

    State: ``index`` (block hash -> replicas, filled by ``on_routed``) and ``pins``
    (session/group -> replica, with each pin's own in-flight count). ``select`` reads
    state (without touching LRU positions); ``on_routed`` (which does) / ``on_finished`` write it.

    * A pin holds while its replica is healthy and present, unless staying costs more than
      moving (``cache_policy.move_rule``: the replica is saturated and another one holds
      the prefix, or has room and the prefix is cheaper to prefill again than the wait); a
      session with a request in flight never moves. A pin on an unhealthy or absent
      replica moves at once to the healthy replica with the longest prefix, ties -> least
      loaded -> rng. A move is ``REPIN``; ``Decision.extra`` says ``moved_pin`` and ``from``.
    * Without a pin, the replica holding the most leading blocks wins (``PREFIX``) when it
      holds at least ``cache_threshold`` of the request's blocks (and at least one),
      unless the balance guard engages (``BALANCE``: least loaded, ties -> longest prefix
      -> rng). Otherwise the replica with the least load plus requests sent to it lately
      (``LOAD``; ``cache_policy.sent``), ties -> rng.
    """

    name = "prefix_affinity"

    def __init__(self, cfg: PolicyConfig, rng: random.Random, pins: KeyRegistry | None = None) -> None:
        self.cfg = cfg
        self.rng = rng
        self.index = PrefixIndex(cfg.max_index_blocks, cfg.predicted_ttl_s)
        self.pins = pins if pins is not None else KeyRegistry(cfg.max_pins, cfg.key_ttl_s)
        self.sent = RecentlySent(cfg.balance_window_s)
        """Engine requests this router placed on each replica lately (a fan-out counts K): with
        the load, where a new key goes (see :meth:`_from_prefix_or_load`). Its clock is the pin
        table's (``KeyRegistry.now``: ``DecisionCore`` advances it)."""

    def select(self, request: RequestView, replicas: Sequence[ReplicaView]) -> Decision | None:
        """Where ``request`` should go; ``None`` when no replica is healthy."""
        candidates = healthy(replicas)
        if not candidates:
            return None
        matched = self.index.match(request.block_hashes, touch=False)  # on_routed's insert touches them
        if request.session_id is not None or request.group_id is not None:
            pinned = self._from_pins(request, {r.replica_id: r for r in replicas}, candidates, matched)
            if pinned is not None:
                return pinned
        return self._from_prefix_or_load(request, candidates, matched)

    def on_routed(self, request: RequestView, decision: Decision) -> None:
        """Pin the session (always) and the group (if new or moved); index the prompt."""
        rid, count = decision.replica_id, request.fan_out
        if request.session_id is not None:
            self.pins.record("session", request.session_id, rid)
            self.pins.started("session", request.session_id, rid, count)
        if request.group_id is not None:
            moved = decision.extra.get("moved_pin") == "group"
            if moved or self.pins.get("group", request.group_id) is None:
                self.pins.record("group", request.group_id, rid)
            self.pins.started("group", request.group_id, rid, count)
        self.index.insert(request.block_hashes, rid, defer=True)  # DecisionCore.settle applies it
        self.sent.add(rid, count, self.pins.now)

    def on_finished(self, request: RequestView, replica_id: ReplicaId) -> None:
        """Release the request's share of its pins' own in-flight counts."""
        if request.session_id is not None:
            self.pins.finished("session", request.session_id, replica_id, request.fan_out)
        if request.group_id is not None:
            self.pins.finished("group", request.group_id, replica_id, request.fan_out)

    def on_rejected(self, request: RequestView, decision: Decision) -> None:
        """The request prefilled nothing there (``DecisionCore`` undoes its placement): un-index the
        blocks it added (those past the prefix it already held), so later requests are not
        predicted to hit them, and take it out of the requests sent lately (a replica that refuses
        work, or whose clients leave while they wait, would otherwise look busier than it is)."""
        self.index.remove(request.block_hashes[decision.matched_blocks:], decision.replica_id)
        self.sent.undo(decision.replica_id, request.fan_out, self.pins.now)

    def on_replicas_changed(self, replica_ids: Sequence[ReplicaId]) -> None:
        """Drop the pins and index entries of replicas no longer in ``replica_ids``."""
        current = set(replica_ids)
        for gone in (self.index.replicas() | self.pins.replicas() | set(self.sent)) - current:
            self.forget_replica(gone)
            self.sent.drop(gone)
        for rid in current - set(self.sent):  # a replica joining late is not sent every new key
            self.sent.level(rid)

    def on_cache_reset(self, replica_id: ReplicaId) -> None:
        """``replica_id``'s prefix cache was emptied: predict no hits there (pins stay)."""
        self.index.remove_replica(replica_id)

    def on_service(self, replica_id: ReplicaId, in_service: bool) -> None:
        """``replica_id`` went out of service or came back: back, it was sent nothing while out,
        and at its count it would take every new key until level again (a burst onto one replica)."""
        self.sent.set_in_service(replica_id, in_service)

    def forget_replica(self, replica_id: ReplicaId) -> None:
        """Forget ``replica_id``'s pins and blocks (it left, restarted or flushed its cache)."""
        self.index.remove_replica(replica_id)
        self.pins.drop_replica(replica_id)
        if replica_id in self.sent:  # back empty: level with the least-sent replica, not below it
            self.sent.level(replica_id)

    def check_integrity(self) -> None:
        """Raise ``RuntimeError('bug: ...')`` if the index or the pin table is corrupt."""
        self.index.check_integrity()
        self.pins.check_integrity()

    def _from_pins(
        self,
        request: RequestView,
        by_id: Mapping[ReplicaId, ReplicaView],
        candidates: Sequence[ReplicaView],
        matched: Mapping[ReplicaId, int],
    ) -> Decision | None:
        keys = {"session": request.session_id, "group": request.group_id}
        for kind, reason in _PIN_ORDER:
            key = keys[kind]
            pin = self.pins.get(kind, key) if key is not None else None
            if pin is None:
                continue
            view = by_id.get(pin.replica)
            if view is None or not view.healthy:
                return self._repin(kind, pin, longest_prefix(candidates, matched, self.rng), matched)
            target = self._cheaper_elsewhere(kind, view, pin, request, candidates, matched)
            if target is None:
                return _decide(view, reason, matched)
            return self._repin(kind, pin, target, matched)
        return None

    def _cheaper_elsewhere(self, kind: PinKind, view: ReplicaView, pin: Pin, request: RequestView,
                           candidates: Sequence[ReplicaView],
                           matched: Mapping[ReplicaId, int]) -> ReplicaView | None:
        """Where the pin should move although its replica is healthy, or None to stay."""
        if kind == "session" and pin.own_in_flight > 0:
            return None  # never in the middle of a request
        return move_target(view, request, candidates, matched, self.cfg, self.rng)

    @staticmethod
    def _repin(kind: PinKind, pin: Pin, chosen: ReplicaView, matched: Mapping[ReplicaId, int]) -> Decision:
        extra = {"moved_pin": kind, "from": str(pin.replica)}
        return _decide(chosen, RouteReason.REPIN, matched, extra)

    def _from_prefix_or_load(
        self,
        request: RequestView,
        candidates: Sequence[ReplicaView],
        matched: Mapping[ReplicaId, int],
    ) -> Decision:
        n_blocks = len(request.block_hashes)
        if not matched:  # a new prompt: held nowhere (the common case, and the whole scan at 1,024 replicas)
            return _decide(self._least_loaded(candidates), RouteReason.LOAD, matched)
        best = longest_prefix(candidates, matched, self.rng)
        hit = matched.get(best.replica_id, 0)
        if hit == 0 or hit < self.cfg.cache_threshold * n_blocks:
            return _decide(self._least_loaded(candidates), RouteReason.LOAD, matched)
        floor = min(load(c) for c in candidates)
        if self._imbalanced(candidates) and load(best) > floor:
            idle = [c for c in candidates if load(c) == floor]
            chosen = longest_prefix(idle, matched, self.rng)
            return _decide(chosen, RouteReason.BALANCE, matched)
        return _decide(best, RouteReason.PREFIX, matched)

    def _least_loaded(self, candidates: Sequence[ReplicaView]) -> ReplicaView:
        """Where a new key goes: the least ``load + sent`` (``cache_policy.sent``)."""
        return least_loaded(candidates, self.rng, self.sent.raw, self.sent.scale(self.pins.now))

    def _imbalanced(self, candidates: Sequence[ReplicaView]) -> bool:
        loads = [load(c) for c in candidates]
        hi, lo = max(loads), min(loads)
        return hi - lo > self.cfg.balance_abs_threshold and hi > self.cfg.balance_rel_threshold * lo


def _decide(
    view: ReplicaView,
    reason: RouteReason,
    matched: Mapping[ReplicaId, int],
    extra: dict[str, str] | None = None,
) -> Decision:
    return Decision(
        replica_id=view.replica_id,
        reason=reason,
        matched_blocks=matched.get(view.replica_id, 0),
        extra=extra or {},
    )
