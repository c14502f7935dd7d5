"""Admission: admit, queue or reject a routed request by its replica's KV budget (DESIGN rule 3).

A request is admitted when its replica's projected KV usage (live working set from
``vllm:kv_cache_usage_perc``, plus blocks admitted but not yet seen in a scrape, plus the
blocks this request adds beyond its expected prefix hit) stays at or under
``high_watermark``. Otherwise it waits in a bounded queue, continuing sessions first;
past ``max_queue`` it is rejected (429 with Retry-After). The point is to keep live
rollouts' prefixes from being evicted and prefilled twice. Times are float seconds from
the caller's clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import msgspec

from cache_policy.admission_queue import PRIORITIES, AdmissionQueueStore, AdmissionRequest, Priority
from cache_policy.config import PolicyConfig
from cache_policy.types import ReplicaId, ReplicaView

__all__ = [
    "PRIORITIES",
    "AdmissionDecision",
    "AdmissionQueue",
    "AdmissionRequest",
    "Priority",
    "Verdict",
    "blocks_needed",
    "classify",
    "fits",
    "projected_usage",
    "queue_capacity",
]

Verdict = Literal["admit", "queue", "reject"]

WAIT_WEIGHT = 0.1
"""Weight of the newest admitted request's wait in the queue's moving average wait."""

_EPS = 1e-9
"""Slack on the watermark comparison, so float noise (0.8 + 0.05) cannot flip a verdict."""


class AdmissionDecision(msgspec.Struct, frozen=True):
    """What to do with one request.

    ``reason``: ``idle``, ``under_watermark``, ``under_in_flight_cap`` (admit);
    ``kv_watermark``, ``parked_prefix``, ``session_budget``, ``in_flight_cap``, ``queued_behind``
    (queue or reject);
    ``queue_full`` (reject). ``retry_after_s`` is set on reject only. ``displaced`` is a
    lower-priority queued request pushed out to make room: the caller rejects it (429).
    """

    verdict: Verdict
    reason: str
    retry_after_s: float | None = None
    projected_usage: float | None = None
    displaced: AdmissionRequest | None = None


def queue_capacity(cfg: PolicyConfig, replicas: int) -> int:
    """Requests that may wait for admission in a fleet of ``replicas``."""
    return max(cfg.max_queue, cfg.max_queue_per_replica * max(0, replicas))


def classify(session_live: bool, group_started: bool, group_waiting: bool = False) -> Priority:
    """Priority class: a live session continues; a started group's member; else new.

    A member whose group's first request still waits (``group_waiting``) is new like it, so it
    queues behind it (no overtaking within a class) and the group is admitted together. Ranked
    above its first request, the siblings were admitted ahead of it and each prefilled the group
    prompt (GRPO 1.14-1.3x ideal prefilled with admission, 1.0 without, ``bench.sim``). Ranking
    every first member with started groups instead starved new sessions (turn p99 52-187 s)."""
    if session_live:
        return "continuing_session"
    return "group_member" if group_started and not group_waiting else "new"


def blocks_needed(num_tokens: int, matched_blocks: int, block_size: int) -> int:
    """Blocks a request of ``num_tokens`` (prompt + max new tokens) adds beyond its hit."""
    if block_size <= 0:
        raise ValueError(f"block_size must be a positive number of tokens, got {block_size}")
    if num_tokens < 0 or matched_blocks < 0:
        raise ValueError(
            f"num_tokens and matched_blocks must be >= 0, got {num_tokens}, {matched_blocks}"
        )
    return max(0, math.ceil(num_tokens / block_size) - matched_blocks)


def projected_usage(replica: ReplicaView, pending_blocks: int, new_blocks: int) -> float | None:
    """``kv_cache_usage + (pending_blocks + new_blocks) / num_gpu_blocks``, a fraction.

    ``None`` when ``num_gpu_blocks == 0`` (capacity unknown: use the in-flight fallback).
    """
    if pending_blocks < 0 or new_blocks < 0:
        raise ValueError(
            f"pending_blocks and new_blocks must be >= 0, got {pending_blocks}, {new_blocks}"
        )
    if replica.num_gpu_blocks == 0:
        return None
    return replica.kv_cache_usage + (pending_blocks + new_blocks) / replica.num_gpu_blocks


def fits(
    replica: ReplicaView, pending_blocks: int, new_blocks: int, cfg: PolicyConfig, guard_blocks: int = 0,
) -> tuple[bool, str, float | None]:
    """Whether ``new_blocks`` fit on ``replica`` now: ``(ok, reason, projected usage)``.

    An idle replica (nothing in flight or pending) always admits, so a request larger
    than the watermark still runs. With unknown capacity, admit while
    ``in_flight < max_in_flight_per_replica``. ``guard_blocks``: blocks to leave free beyond
    the watermark so parked prefixes survive eviction (``AdmissionState.parked_guard``;
    reason ``parked_prefix`` when only they stand in the way).
    """
    usage = projected_usage(replica, pending_blocks, new_blocks)
    if replica.in_flight == 0 and pending_blocks == 0:
        return True, "idle", usage
    if usage is not None:
        ok = usage <= cfg.high_watermark + _EPS
        if ok and guard_blocks and usage + guard_blocks / replica.num_gpu_blocks > cfg.high_watermark + _EPS:
            return False, "parked_prefix", usage
        return ok, "under_watermark" if ok else "kv_watermark", usage
    ok = replica.in_flight < cfg.max_in_flight_per_replica
    return ok, "under_in_flight_cap" if ok else "in_flight_cap", None


class AdmissionQueue:
    """The bounded admission queue and the admit/queue/reject decision.

    Service order: continuing sessions (round-robin over session ids), then members of
    started groups, then new requests, FIFO within each (see ``AdmissionQueueStore``).
    A request never overtakes a queued one of equal or higher priority on the same
    replica. At most :attr:`capacity` requests wait; a full queue displaces its newest
    lowest-priority request for a higher-priority one, else rejects.

    A GRPO group is admitted as one: a member whose group already has a request in flight on
    its replica is admitted at once, whatever the watermark and whatever waits there. Its
    prompt is in use, so it adds only its own tokens (still counted against the replica).
    Held back at the watermark, members were admitted one by one over ~20 s and the prompt
    was evicted and prefilled 2-5 times (12 of 42 groups, ``bench.sim`` 4 replicas ws/kv 2;
    GRPO 1.46x ideal prefilled with admission, 1.00 with this rule, 1.02 without admission).
    The first member alone waits for room.
    """

    def __init__(self, cfg: PolicyConfig) -> None:
        self.cfg = cfg
        self._store = AdmissionQueueStore()
        self._replicas = 1
        self._wait_s: float | None = None
        """Recent queue wait of admitted requests (moving average), seconds; None before one."""
        self._most = queue_capacity(cfg, 1)

    @property
    def replicas(self) -> int:
        """Replicas in the fleet (the caller keeps it current): the bound grows with them."""
        return self._replicas

    @replicas.setter
    def replicas(self, n: int) -> None:
        self._replicas = n
        self._most = max(self._most, self.capacity)  # a shrunk fleet's queue may hold more for a while

    @property
    def capacity(self) -> int:
        """``max(max_queue, max_queue_per_replica * replicas)``: a fleet-wide bound starved a
        64-replica fleet (~4 waiting per replica) into 429s (see ``PolicyConfig``)."""
        return queue_capacity(self.cfg, self.replicas)

    def __len__(self) -> int:
        return len(self._store)

    @property
    def requests_by_replica(self) -> Mapping[ReplicaId, int]:
        """Engine requests queued per replica (a fan-out counts K; read-only)."""
        return self._store.requests_by_replica

    @property
    def changed(self) -> set[ReplicaId]:
        """Replicas whose :attr:`requests_by_replica` changed since the core last rebuilt their
        views (``DecisionCore._views_of`` empties it)."""
        return self._store.changed

    def has_group(self, group_id: str | None) -> bool:
        """Whether a request of GRPO group ``group_id`` waits."""
        return self._store.has_group(group_id)

    def waiting(self) -> list[AdmissionRequest]:
        """Queued requests, in service order."""
        return self._store.in_order()

    def admit(
        self, request: AdmissionRequest, replica: ReplicaView, pending_blocks: int, *,
        with_group: bool = False, guard_blocks: int = 0, sessions_full: bool = False,
    ) -> AdmissionDecision:
        """Admit ``request`` now, queue it (the queue keeps it) or reject it.

        ``pending_blocks``: blocks admitted to ``replica`` not yet reflected in its
        ``kv_cache_usage``. ``request.enqueued_at`` is taken as now. ``with_group``: a request
        of its GRPO group is in flight on the replica: admitted at once (see the class).
        """
        if with_group:
            usage = projected_usage(replica, pending_blocks, request.new_blocks)
            return AdmissionDecision("admit", "with_group", projected_usage=usage)
        if request.replica_id != replica.replica_id:
            raise ValueError(
                f"replica {replica.replica_id!r} is not the request's {request.replica_id!r}"
            )
        ok, reason, usage = fits(replica, pending_blocks, request.new_blocks, self.cfg, guard_blocks)
        if sessions_full and request.opens_session:
            ok, reason = False, "session_budget"
        if self._store.has_waiting(request.replica_id, request.priority):
            ok, reason = False, "queued_behind"
        if ok:
            return AdmissionDecision("admit", reason, projected_usage=usage)
        if len(self._store) < self.capacity:
            self._store.push(request)
            return AdmissionDecision("queue", reason, projected_usage=usage)
        victim = self._store.displaceable(request.priority) if self.capacity else None
        if victim is None:
            retry = self.retry_after_s(request.enqueued_at)
            return AdmissionDecision("reject", "queue_full", retry, usage)
        self._store.remove([victim])
        self._store.push(request)
        return AdmissionDecision("queue", reason, projected_usage=usage, displaced=victim)

    def retry_after_s(self, now: float) -> float:
        """When room should be there: the queue's recent wait (an average over the requests it
        admitted, weight ``WAIT_WEIGHT`` on the newest), else the oldest request's expiry;
        within [1, queue_timeout_s].

        The oldest request's expiry is up to ``queue_timeout_s`` away when the queue drains
        much faster: refused requests then sat out 30 s for nothing (31-109 s turn tails in
        ``bench.sim`` at 64 replicas)."""
        timeout = self.cfg.queue_timeout_s
        oldest = self._store.oldest_enqueued_at()
        left = timeout if oldest is None else oldest + timeout - now
        if self._wait_s is not None:
            left = self._wait_s
        return min(max(left, 1.0), max(timeout, 1.0))

    def pop_admissible(
        self, replicas: Sequence[ReplicaView], pending: Mapping[ReplicaId, int], now: float,
        group_running: Callable[[str | None, ReplicaId], bool] = lambda g, r: False,
        guards: Mapping[ReplicaId, int] | None = None,
        sessions_full: Callable[[ReplicaId, list[int]], bool] = lambda rid, opened: False,
    ) -> list[AdmissionRequest]:
        """Remove and return the queued requests that fit now, in service order.

        ``pending``: per replica, blocks admitted but not yet in its usage (missing = 0).
        Requests popped here count against their replica for the later ones. Once one
        request for a replica does not fit, none behind it for that replica is taken (no
        overtaking), except a GRPO member whose group runs there (``group_running``) or had
        a member taken in this pass: it goes with its group (see the class). Requests
        whose replica is absent or unhealthy, or already expired at ``now``, stay queued (see
        ``drop_replica`` and ``expire``). ``sessions_full(rid, opened)``: whether ``rid`` has no
        room for one more session when the sessions ``opened`` there in this pass (their blocks)
        are counted too (``AdmissionState.sessions_full``).
        """
        views = {r.replica_id: r for r in replicas}
        extra_blocks = {rid: pending.get(rid, 0) for rid in views}
        extra_in_flight = dict.fromkeys(views, 0)
        blocked: set[ReplicaId] = set()
        groups: set[tuple[str | None, ReplicaId]] = set()  # groups with a member taken in this pass
        taken: list[AdmissionRequest] = []
        joined: dict[int, AdmissionRequest] = {}  # members admitted with their running group
        opened: dict[ReplicaId, list[int]] = {}  # per replica, the holds of sessions opened in this pass
        timeout = self.cfg.queue_timeout_s
        for req in self._store.in_order():  # a long queue is mostly requests of blocked replicas: cheap tests first
            rid = req.replica_id
            joins = req.group_id is not None and ((req.group_id, rid) in groups or group_running(req.group_id, rid))
            if rid in blocked and not joins:
                continue
            view = views.get(rid)
            if view is None or not view.healthy or now - req.enqueued_at > timeout:  # _expired, inlined
                continue
            now_view = msgspec.structs.replace(view, in_flight=view.in_flight + extra_in_flight[rid])
            guard = guards.get(rid, 0) if guards and req.priority != "continuing_session" else 0
            if not joins and (req.opens_session and sessions_full(rid, opened.get(rid, []))
                              or not fits(now_view, extra_blocks[rid], req.new_blocks, self.cfg, guard)[0]):
                blocked.add(rid)
                continue
            if req.opens_session:  # counted for the next one: all at once, they outgrew the cache
                opened.setdefault(rid, []).append(req.holds)
            taken.append(req)
            if joins:
                joined[id(req)] = req.joined()
            groups.add((req.group_id, rid))
            extra_blocks[rid] += joined[id(req)].new_blocks if joins else req.new_blocks
            extra_in_flight[rid] += req.requests  # engine requests: a fan-out or n samples count each
        self._store.remove(taken, served=True)
        taken = [joined.get(id(r), r) for r in taken]
        for req in taken:
            wait = max(0.0, now - req.enqueued_at)
            self._wait_s = wait if self._wait_s is None else self._wait_s + WAIT_WEIGHT * (wait - self._wait_s)
        return taken

    def expire(self, now: float) -> list[AdmissionRequest]:
        """Remove and return requests queued longer than ``queue_timeout_s`` (reject them)."""
        oldest = self._store.oldest_enqueued_at()
        if oldest is None or not now - oldest > self.cfg.queue_timeout_s:  # then none is (_expired)
            return []
        gone = [r for r in self._store.in_order() if self._expired(r, now)]
        self._store.remove(gone)
        return gone

    def remove(self, request: AdmissionRequest) -> bool:
        """Take ``request`` out of the queue at once (its client went away); False if absent."""
        present = any(r is request for r in self._store.in_order())
        self._store.remove([request])
        return present

    def take(self, requests: list[AdmissionRequest]) -> None:
        """Remove ``requests`` (queued ones, by identity) in one pass over the queue."""
        self._store.remove(requests)

    def drop_replica(self, replica_id: ReplicaId) -> list[AdmissionRequest]:
        """Remove and return the requests queued for ``replica_id`` (re-route them)."""
        gone = [r for r in self._store.in_order() if r.replica_id == replica_id]
        self._store.remove(gone)
        return gone

    def check_integrity(self) -> None:
        """Raise ``RuntimeError('bug: ...')`` if the queue is over capacity or malformed."""
        if len(self._store) > self._most:
            raise RuntimeError(f"bug: {len(self._store)} queued > capacity {self._most}")
        self._store.check_integrity()

    def _expired(self, req: AdmissionRequest, now: float) -> bool:
        return now - req.enqueued_at > self.cfg.queue_timeout_s
