"""AdmissionState: the admission state machine of DESIGN rule 3 (queue + ledger + projection).

Operations return decisions; nothing waits here. A routed request *asks* for room on its
replica and is admitted (a ``Ticket``), queued, or rejected; a finished request *releases*
its ticket (its session's prefix is then parked); *pump* admits what fits now and refuses
what waited too long. See ``cache_policy.ledger`` for the projection's picture.

A replica with nothing in flight admits the first queued request whatever the projection
(``cache_policy.admission.fits``), so parked prefixes can slow new work but never stall it.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import msgspec

from cache_policy.admission import AdmissionQueue, AdmissionRequest, classify, fits
from cache_policy.config import PolicyConfig
from cache_policy.ledger import KvLedger, Ticket
from cache_policy.registry import KeyRegistry
from cache_policy.types import ReplicaId, ReplicaView

Verdict = Literal["admit", "queue", "reject"]
SESSION_WEIGHT = 0.1
"""Weight of the newest ended session in the moving average of sessions' final KV blocks."""
TOUCHED_KEPT = 8192
"""Free-queue stamps of hit blocks kept per replica for :meth:`AdmissionState.parked_guard`."""
UNPARK_EVERY_S = 0.25
"""How often (in the caller's seconds) ``pump`` stops counting idle sessions' parked prefixes."""


class Admission(msgspec.Struct, frozen=True):
    """What admission decided for one request.

    ``verdict``: admit (``ticket`` set), queue (wait for a pump), reject (429 with
    ``retry_after_s``). ``reason``: idle, under_watermark, under_in_flight_cap (admit);
    kv_watermark, parked_prefix, in_flight_cap, queued_behind (queue); queue_full, timeout, displaced
    (reject); replica_gone (the replica it waited for left: place it again).
    """

    verdict: Verdict | Literal["replica_gone"]
    reason: str
    retry_after_s: float | None = None
    ticket: Ticket | None = None
    waited: bool = False


def project(view: ReplicaView, ledger: KvLedger, registry: KeyRegistry, *, parked: bool = True) -> ReplicaView:
    """``view`` as admission sees it: the in-flight count, and as ``kv_cache_usage`` the
    projected usage ``(max(scraped * blocks + unseen, committed) + parked) / blocks``.

    With several routers (``ledger.peers``) the in-flight count, ``unseen`` and ``committed``
    include the other routers' shares, so N routers together respect the watermark.
    A replica of unknown size (``num_gpu_blocks == 0``) keeps its scraped usage. ``parked=False``:
    the running work alone (parked prefixes sit in vLLM's free queue, evictable).
    """
    rid, cap = view.replica_id, view.num_gpu_blocks
    count = ledger.count(rid) + ledger.peer(rid).requests
    usage = ((running_blocks(view, ledger) + (registry.parked_blocks(rid) if parked else 0)) / cap if cap
             else view.kv_cache_usage)
    # built field by field: dataclasses.replace() took two thirds of this function's time
    return ReplicaView(rid, view.healthy, count, usage, view.num_running, view.num_waiting, cap, view.block_size,
                       view.scoring_cap, view.weight_version, view.queued)


def running_blocks(view: ReplicaView, ledger: KvLedger, unused: int = 0, unused_unseen: int = 0) -> float:
    """Blocks the requests in flight on ``view``'s replica hold once they reach their peak:
    ``max(scraped usage * blocks + unseen, committed)``, every router's share included
    (``view.kv_cache_usage`` is the scraped usage here, not a projection). ``unused`` /
    ``unused_unseen``: blocks counted at a peak in ``committed`` / ``unseen`` known never to
    be reached (a finished request's peak past what it generated)."""
    rid, peer = view.replica_id, ledger.peer(view.replica_id)
    return max(view.kv_cache_usage * view.num_gpu_blocks + ledger.unseen(rid) + peer.unseen - unused_unseen,
               ledger.committed(rid) + peer.committed - unused)


def parked_limit(cfg: PolicyConfig, capacity: int) -> int | None:
    """Blocks parked prefixes may count on a replica of ``capacity`` blocks (None: unknown size).

    ``parked_fraction`` of the watermark budget: the rest always stays for running work.
    Uncapped, parked prefixes outgrew the cache in ``bench.sim`` (ws/kv 2) and only an idle
    replica admitted (one request at a time; DESIGN rule 3 is about live prefixes, and a
    prefix that cannot fit beside the work that would reuse it is not kept by refusing work)."""
    return int(cfg.parked_fraction * cfg.high_watermark * capacity) if capacity > 0 else None


class AdmissionState:
    """The queue, the ledger and the rules that join them. With ``enabled=False`` every
    request is admitted at once (the ledger still counts it)."""

    def __init__(self, cfg: PolicyConfig, registry: KeyRegistry, *, enabled: bool = True) -> None:
        self.cfg = cfg
        self.enabled = enabled
        self.registry = registry
        self.queue = AdmissionQueue(cfg)
        self.ledger = KvLedger()
        self._numbers = itertools.count()
        self._unparked_at = float("-inf")
        self._touched: dict[ReplicaId, list[int]] = {}
        """Per replica, the free-queue stamps of blocks hits took out of the queue, sorted."""
        self.session_blocks: float | None = None
        """Blocks an ended session held at its last turn (moving average; None before one ended).
        A session ends by its client's word (``X-Session-End``, ``DELETE /v1/sessions/{id}``) or
        by going unseen for ``session_idle_s`` (then its parked prefix is the sample)."""
        self.largest_session_blocks = 0
        """The most blocks one request of a session has held (at its release): what
        :meth:`sessions_full` counts sessions at until one has ended (:attr:`session_blocks`)."""

    def request(self, rid: ReplicaId, total_blocks: int, matched_blocks: int, session_id: str | None,
                group_id: str | None, requests: int, now: float, request_id: str = "",
                prompt_blocks: int = 0) -> AdmissionRequest:
        """The queue's view of a request of ``total_blocks`` at its peak, ``matched_blocks`` of them
        expected cached: its priority and the blocks it adds to the projection. Marks its session
        and group seen (a group's later members are a started group's). ``prompt_blocks``: its
        full prompt blocks, which a GRPO member shares with its group (see
        ``AdmissionRequest.joined_holds``)."""
        idle = self.cfg.session_idle_s
        live = self.registry.is_live("session", session_id, now, idle)
        started = self.registry.is_live("group", group_id, now, idle)
        if live:
            self.registry.seen("session", session_id, now)
        if group_id is not None:
            self.registry.seen("group", group_id, now)
        priority = classify(live, started, self.queue.has_group(group_id))
        holds = total_blocks - min(matched_blocks, total_blocks) if started and not live else total_blocks
        counted = min(self.registry.parked_of(session_id, rid), total_blocks)
        joined = total_blocks - min(max(matched_blocks, prompt_blocks), total_blocks) if group_id is not None else None
        return AdmissionRequest(rid, max(0, holds - counted), priority, session_id, now, request_id, holds, requests,
                                group_id, joined, None if joined is None else max(0, joined - counted))

    def parked_guard(self, view: ReplicaView, freed: int | None) -> int:
        """Blocks new work must leave free on ``view``'s replica beyond the watermark budget so
        that the prefixes parked there survive vLLM's eviction order (0: none needed or known).

        A parked prefix sits in the engine's free queue; every block new work allocates is taken
        from the queue's head, the oldest freed first (``cache_policy.free_queue``). Counting the
        prefix against the watermark keeps room for it, but not its place in the queue: blocks
        of finished work freed after it are evicted after it. Its deepest block, of rank
        ``k = freed - stamp`` from the tail, survives while the requests in flight hold at most
        ``capacity - 1 - k`` blocks at their peak; new work (not a parked session's own next
        turn) is admitted only within that. A prefix already past saving (its rank above the
        free blocks left at the current peak) stops counting: refusing work cannot keep it.
        ``freed``: the replica's ``FreeQueueModel.freed`` counter (None: no model, no guard)."""
        cap = view.num_gpu_blocks
        if not cap or freed is None or not self.enabled:
            return 0
        rid = view.replica_id
        committed = self.ledger.committed(rid) + self.ledger.peer(rid).committed
        taken = self._touched.get(rid, ())
        lost, rank = [], None
        for rec in self.registry.parked_on(rid):  # oldest first: the first one kept decides
            if rec.parked_stamp is None:
                continue
            rank = freed - rec.parked_stamp - (len(taken) - bisect.bisect_right(taken, rec.parked_stamp))
            if rank <= cap - 1 - committed:
                break
            lost.append(rec)
            rank = None
        for rec in lost:
            self.registry.drop_parked(rec)
        if rank is None:
            return 0
        budget = self.cfg.high_watermark * cap - self.registry.parked_blocks(rid)
        return max(0, math.ceil(budget - (cap - 1 - rank)))

    def sessions_full(self, view: ReplicaView, now: float, opening: Sequence[int] = ()) -> bool:
        """Whether ``view``'s replica has no room for one more session: the sessions live there
        (parked or running), each counted at the larger of what it holds and what sessions end
        at (:attr:`session_blocks`), plus one more at that size, would pass
        ``session_fraction`` of the watermark budget. Until a session has ended (by its client's
        word or by going idle), sessions are counted at the largest any has grown to so far
        (:attr:`largest_session_blocks`; False before one has finished a turn).

        A session's first turn is small and its prefix grows every turn; admitted by its first
        turn alone, more sessions started on a replica than its cache could keep between turns,
        and every one re-prefilled its context (``bench.sim`` 4 replicas, ws/kv 2: agent turns
        4.5x ideal; with this rule 1.5x). A waiting session starts when one ends or goes idle;
        a parked session unseen for half of ``queue_timeout_s`` no longer counts here (see
        ``PolicyConfig.session_fraction``). ``opening``: the blocks of sessions admitted there in
        the same pump pass, not yet in the ledger (each counted like a running one: a pass that
        asked once per replica started 5-6 sessions together where one fitted, and their
        contexts outgrew the cache: ``bench.sim`` agents 1.9x ideal at 4 replicas).

        A replica holding no session always has room for one (one large session, live or ended,
        would otherwise make every replica full for good: no session could start and teach a
        smaller size; a fresh attacker's case).

        The bound before any session ended is a lower bound that grows with the sessions: without
        it every session arriving in a fleet's first minute started, a few replicas got more than
        their caches could keep, and their turns re-prefilled until those sessions ended
        (``bench.sim`` 64 replicas, ws/kv 2, mixed: on seed 3, 98% of ours' excess prefill came in
        the first 40 simulated seconds; seeds 0-4 prefilled/ideal 1.09-1.21 -> 1.026-1.034)."""
        expected, cap = self.session_blocks, view.num_gpu_blocks
        if expected is None:
            expected = self.largest_session_blocks or None
        if expected is None or not cap or not self.enabled:
            return False
        rid = view.replica_id
        recent = now - self.cfg.queue_timeout_s / 2  # parked and unseen since: likely abandoned
        held = sum(max(expected, rec.parked[1]) for rec in self.registry.parked_on(rid)
                   if rec.parked and rec.last_seen >= recent)
        held += sum(max(expected, t.blocks) for t in self.ledger.tickets(rid) if t.session_id is not None)
        held += sum(max(expected, blocks) for blocks in opening)
        return held > 0 and held + expected > self.cfg.session_fraction * self.cfg.high_watermark * cap

    def touched(self, rid: ReplicaId, stamps: list[int]) -> None:
        """A request took free blocks released at ``stamps`` out of ``rid``'s free queue (its
        prefix hit): every parked prefix released before one of them is one place closer to the
        tail (``FreeQueueModel.hold``). Counted in :meth:`parked_guard` from a sorted list of the
        stamps taken after the oldest parked prefix's (older ones count for no parked prefix, and
        later parks have later stamps), at most ``TOUCHED_KEPT`` per replica, the oldest dropped
        first (a prefix then looks deeper than it is: conservative). Counting a resumed session's
        own prefix as allocation instead declared older parked prefixes lost that the engine still
        held (``bench.sim`` 4 replicas ws/kv 2: 1.35x ideal prefilled without the correction, 1.26x
        with it)."""
        oldest = next((r.parked_stamp for r in self.registry.parked_on(rid) if r.parked_stamp is not None), None)
        if oldest is None:
            self._touched.pop(rid, None)
            return
        new = [stamp for stamp in stamps if stamp > oldest]
        if new:
            taken = self._touched.setdefault(rid, [])
            taken.extend(new)
            taken.sort()  # a sorted run plus a short one: linear in C
            if len(taken) > TOUCHED_KEPT:
                del taken[:len(taken) - TOUCHED_KEPT]

    def sizes(self) -> dict[str, int]:
        """Entries held: ``queued`` requests, the ledger's (:meth:`KvLedger.sizes`) and
        ``touched_stamps`` (at most ``TOUCHED_KEPT`` per replica)."""
        return {"queued": len(self.queue), **self.ledger.sizes(), "touched_stamps": sum(map(len, self._touched.values()))}

    def forget_replica(self, rid: ReplicaId) -> None:
        """``rid`` left or lost its cache: its free-queue bookkeeping goes."""
        self._touched.pop(rid, None)

    def ask(self, request: AdmissionRequest, view: ReplicaView, now: float,
            freed: int | None = None) -> tuple[Admission, list[AdmissionRequest]]:
        """Admit, queue (the queue keeps ``request``) or reject; also the requests it displaced.
        ``freed``: the replica's free-queue counter (see :meth:`parked_guard`)."""
        if not self.enabled:
            return self._admit(request, now, waited=False), []
        with_group = self.ledger.group_running(request.group_id, request.replica_id)
        if with_group:
            request = request.joined()
        guard = self.parked_guard(view, freed) if request.priority != "continuing_session" else 0
        full = request.opens_session and self.sessions_full(view, now)
        decision = self.queue.admit(request, project(view, self.ledger, self.registry), 0, with_group=with_group,
                                    guard_blocks=guard, sessions_full=full)
        displaced = [decision.displaced] if decision.displaced is not None else []
        if decision.verdict == "admit":
            return self._admit(request, now, waited=False), displaced
        if decision.verdict == "reject":
            return Admission("reject", decision.reason, decision.retry_after_s), displaced
        return Admission("queue", decision.reason), displaced

    def release(self, ticket: Ticket, now: float, *, park: bool = True, capacity: int = 0,
                stamp: int | None = None, ends_session: bool = False) -> None:
        """The request ended: free its blocks; park its session's prefix (unless ``park`` is False)
        within :func:`parked_limit` of the replica's ``capacity`` blocks (0: unknown, no limit);
        ``stamp``: the replica's free-queue counter before its blocks were released;
        ``ends_session``: its session's last turn (its size feeds :attr:`session_blocks`)."""
        self.ledger.release(ticket)
        if ticket.session_id is not None:
            rec = self.registry.record_of("session", ticket.session_id)
            if rec is not None and rec.ended:  # its client ended it (DELETE) while this turn waited or ran
                if not rec.end_sampled:  # the end had no parked prefix to sample: this turn was its last
                    self.session_ended(ticket.blocks)
                    rec.end_sampled = True
            elif ends_session:
                self.session_ended(ticket.blocks)
            self.largest_session_blocks = max(self.largest_session_blocks, ticket.blocks)
            # a session evicted over policy.max_pins as its request finished (KeyRegistry.finished) is
            # not made again here without its pin and start version (a fresh attacker's report)
            self.registry.seen("session", ticket.session_id, now, create=False)
            if park:
                self.registry.park(ticket.session_id, ticket.replica_id, ticket.blocks,
                                   parked_limit(self.cfg, capacity), stamp, create=False)

    def expire(self, now: float, view_of: Callable[[ReplicaId], ReplicaView | None] = lambda rid: None,
               ) -> tuple[list[tuple[AdmissionRequest, Admission]], list[AdmissionRequest]]:
        """Queued requests past ``queue_timeout_s``: ``(admitted late, refused)``.

        With ``PolicyConfig.admit_late``, one whose replica (``view_of``: its view while it is
        healthy and in rotation, else None) has room for it beside the work running there, parked
        prefixes not counted, is admitted (reason ``late``): only the rules that keep cached
        prefixes alive (the parked guard and parked blocks, the session share, no overtaking)
        held it. The rest get 429 (``reject``, reason ``timeout``)."""
        late, refused = [], []
        for request in self.queue.expire(now):
            view = view_of(request.replica_id)
            if view is not None and self.enabled and self.cfg.admit_late and self._fits_running(view, request):
                late.append((request, self._admit(request, now, waited=True, reason="late")))
            else:
                refused.append(request)
        return late, refused

    def _fits_running(self, view: ReplicaView, request: AdmissionRequest) -> bool:
        """Whether ``request`` fits the watermark beside the requests in flight alone."""
        return fits(project(view, self.ledger, self.registry, parked=False), 0, request.new_blocks, self.cfg)[0]

    def pump(self, views: list[ReplicaView], now: float,
             freed: Mapping[ReplicaId, int] | None = None) -> list[tuple[AdmissionRequest, Admission]]:
        """Admit every queued request that fits now, in service order. ``views``: replicas in
        rotation (an unhealthy or absent replica's requests stay queued); ``freed``: their
        free-queue counters (see :meth:`parked_guard`)."""
        self.unpark_idle(now)
        freed = freed or {}
        guards = {v.replica_id: self.parked_guard(v, freed.get(v.replica_id)) for v in views}
        by_id = {v.replica_id: v for v in views}
        projected = [project(v, self.ledger, self.registry) for v in views]
        taken = self.queue.pop_admissible(projected, {}, now, group_running=self.ledger.group_running,
                                          guards=guards, sessions_full=lambda rid, opened: self.sessions_full(by_id[rid], now, opened))
        return [(r, self._admit(r, now, waited=True)) for r in taken]

    def unpark_due(self, now: float) -> bool:
        """Whether :meth:`unpark_idle` at ``now`` sweeps (else it does nothing)."""
        return now - self._unparked_at >= UNPARK_EVERY_S

    def unpark_idle(self, now: float) -> None:
        """Sessions unseen for ``session_idle_s`` end, and their parked prefixes stop counting
        (most clients never say a session ended: idle is how it ends). A sweep over every session,
        so at most once per ``UNPARK_EVERY_S`` of ``now``; every :meth:`pump` runs it."""
        if self.unpark_due(now):
            self._unparked_at = now
            waiting = {r.session_id for r in self.queue.waiting() if r.session_id is not None}
            for blocks in self.registry.unpark_idle(now, self.cfg.session_idle_s, waiting):
                self.session_ended(blocks)

    def session_ended(self, blocks: int) -> None:
        """A session ended at ``blocks`` (its last turn, or its parked prefix when it went idle):
        one sample of :attr:`session_blocks`, the size :meth:`sessions_full` counts sessions at."""
        old = self.session_blocks
        self.session_blocks = blocks if old is None else old + SESSION_WEIGHT * (blocks - old)

    def retry_after_s(self, now: float) -> float:
        """Seconds a refused client should wait before trying again."""
        return self.queue.retry_after_s(now)

    def check_integrity(self) -> None:
        """Raise ``RuntimeError('bug: ...')`` if the queue or the ledger is corrupt."""
        self.queue.check_integrity()
        self.ledger.check_integrity()

    def _admit(self, request: AdmissionRequest, now: float, *, waited: bool, reason: str | None = None) -> Admission:
        rid, sid = request.replica_id, request.session_id
        ticket = Ticket(rid, request.holds, request.new_blocks, sid, now, request.priority,
                        next(self._numbers), request.requests, request.group_id)
        self.ledger.admit(ticket)
        if sid is not None:
            self.registry.started_session(sid)
            self.registry.seen("session", sid, now)
        reason = reason or ("waited" if waited else "admitted")
        return Admission("admit", reason, ticket=ticket, waited=waited)
