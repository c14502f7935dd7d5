"""DecisionCore: the one facade ``router/`` (and ``bench/sim``) calls to decide.

Every routing, admission and version decision lives behind it, with all the state they need:

    replicas      ReplicaRecord per replica: size, health, last scraped load
    policy        placement (cache_policy.policy: prefix_affinity | round_robin | least_load)
    registry      sessions and GRPO groups: pins, liveness, start versions, parked prefixes
    admission     queue + KV ledger + projection (cache_policy.admission_state)
    versions      loaded versions, salts, rotation (cache_policy.versions)

One lifecycle per request, whatever its kind (completion, chat, scoring fan-out)::

    open(spec) -> Job        salt, version and block hashes decided
    place(job) -> Decision   replica chosen and recorded (pins, prefix index), or None
    admit(job) -> Admission  admit (ticket) | queue | reject (429); queued jobs come back from pump()
    finish(job, outcome)     ticket released, pins' in-flight released; refused / never-dispatched
                             work un-indexed and unpinned; unreachable replica marked unhealthy

A queued job's fate, and any job displaced or expired as a side effect, is returned by
``pump(now)``: call it after ``admit`` queued something, after ``finish``, and after each
replica event. Pure: no I/O, no clock (``now`` is float seconds from the caller).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from cache_policy import sharing
from cache_policy.admission import blocks_needed, fits
from cache_policy.affinity import PrefixAffinityPolicy
from cache_policy.prefix_index import PrefixIndex
from cache_policy.admission_queue import AdmissionRequest
from cache_policy.admission_state import Admission, AdmissionState, project, running_blocks
from cache_policy.config import PolicyConfig
from cache_policy.free_queue import FreeQueueModel
from cache_policy.hashing import block_hashes
from cache_policy.policy import make_policy
from cache_policy.registry import KeyRegistry
from cache_policy.salts import WeightUpdatePolicy
from cache_policy.types import Decision, ReplicaId, ReplicaView, RequestKind, RequestView, RouteReason
from cache_policy.versions import SaltChoice, VersionBook

Outcome = Literal["ok", "refused", "down", "unreachable", "retry", "abandoned", "preempted", "cancelled", "ended",
                  "failed"]
"""How a job ended: ``ok``; ``refused`` (the replica answered 4xx: it prefilled nothing);
``down`` (connection refused: the replica is marked unhealthy at once, the job may be placed
again); ``unreachable`` (the connection failed, also on a fresh one: one more consecutive
failure of the replica, which leaves rotation at ``failures_out_of_rotation``; the job may be
placed again); ``retry`` (the replica answered 5xx or failed it before anything reached the client,
e.g. a scoring row missing: the job may be placed again, the replica stays; the failure counts
against it only once the job succeeds elsewhere, see ``Job.suspects``); ``abandoned`` (taken back
from a replica a rule already took out of rotation, a stalled engine or one that stopped
answering: placed again elsewhere, no failure counted, it is counted out already; see
``Job.abandoned``); ``preempted`` (a weight update
took the job back before anything reached the client, or its replica's version changed while
it ran: placed again, on the same replica too, no failure counted); ``cancelled`` (the client
went away); ``ended`` (the router ended an answer it had begun: a stream on a replica a failed
weight update left paused, ``router.lifecycle.Lifecycle.left_paused``; no failure counted, the
replica's rotation says why); ``failed`` (any other error after dispatch)."""

MAX_STALL_TIMEOUTS = 8
"""A stalled replica stays out ``stall_timeout_s`` times 1, 2, 4, then at most this, for each stall
in a row without a token finished (``DecisionCore._watch_progress``)."""


class RequestSpec(msgspec.Struct, frozen=True):
    """One parsed request, as the core needs it.

    ``token_ids``: the prompt (a scoring request's context); ``new_tokens``: tokens it may
    generate over all its samples (admission reserves prompt + these); ``fan_out``: engine
    requests sent at once (a scoring fan-out's K responses, a completion's ``n`` samples, which
    vLLM runs as ``n`` child requests), counted in load, pins and the in-flight cap alike; ``ends_session``: the client's last turn of ``session_id``.
    """

    token_ids: tuple[int, ...] | list[int]
    session_id: str | None = None
    group_id: str | None = None
    weight_version: int | None = None
    tenant: str | None = None
    kind: RequestKind = "generate"
    new_tokens: int = 0
    fan_out: int = 1
    ends_session: bool = False

    def __post_init__(self) -> None:
        if self.new_tokens < 0 or self.fan_out < 1:
            raise ValueError(f"new_tokens must be >= 0 and fan_out >= 1, got {self.new_tokens}, {self.fan_out}")


@dataclass(frozen=True)
class ReplicaLoad:
    """One scrape of a replica's own metrics (``vllm:kv_cache_usage_perc`` in [0, 1], ...)."""

    kv_cache_usage: float = 0.0
    num_running: int = 0
    num_waiting: int = 0
    num_gpu_blocks: int = 0
    num_preemptions: int = 0
    finished_tokens: int = 0
    """Counter: prompt plus generated tokens the engine has finished (``vllm:prompt_tokens_total``
    + ``vllm:generation_tokens_total``): whether it makes progress (``DecisionCore.stalled``)."""


@dataclass
class ReplicaRecord:
    """What the core knows of one replica."""

    replica_id: ReplicaId
    block_size: int
    num_gpu_blocks: int
    scoring_cap: bool = False
    healthy: bool = True
    load: ReplicaLoad = field(default_factory=ReplicaLoad)
    failures: int = 0
    """Consecutive failed dispatches (reset by an answer)."""
    busy: bool = False
    """At the last scrape it held work: requests running or waiting by its metrics, or requests
    of this router in flight there that are not answering yet."""
    answering: int = 0
    """Engine requests of this router in flight here whose answer reaches its client already
    (``DecisionCore.answering``): the engine has made their tokens, so only its own gauges tell
    whether it still holds them (a stream a client reads slowly stays in flight long after)."""
    progress_at: float | None = None
    """When a scrape last began that showed the engine's ``finished_tokens`` moved, or followed one
    that showed it idle, or found the replica in a weight update: since then it held work and
    finished nothing (``DecisionCore.stalled``). None before the first scrape."""
    checked_at: float | None = None
    """When a scrape last began that showed ``finished_tokens`` move (or first saw the engine), or
    a probe was last sent: an idle engine is probed once this is ``policy.stall_probe_after_s``
    old (:meth:`DecisionCore.probe_due`), so at most once a period, whatever its counters do."""
    probing: bool = False
    """A probe of the router is in flight there (:meth:`DecisionCore.probe_sent`): held work."""
    suspect: bool = False
    """It stalled and has neither finished a token nor answered a probe since: with probes on,
    it stays out past its stall's end until one of them shows it moves (:meth:`DecisionCore.stalled`)."""
    stalls: int = 0
    """Stalls in a row, with no token finished since the first."""
    stalled_until: float | None = None
    """The present (or last) stall ends then, unless a token moves first."""
    incarnation: int = 0
    """Which joining or restart of the replica this is (unique in the core, never reused)."""

    def view(self, version: int | None) -> ReplicaView:
        """A snapshot for the policies (``in_flight`` is filled in by the core)."""
        return ReplicaView(self.replica_id, self.healthy, 0, self.load.kv_cache_usage, self.load.num_running,
                           self.load.num_waiting, self.load.num_gpu_blocks or self.num_gpu_blocks,
                           self.block_size, self.scoring_cap, version)


@dataclass(eq=False)
class Job:
    """One request's life in the core. The router holds it between calls and reads
    ``salt``, ``decision``, ``weight_version`` and ``expected_cached_tokens``."""

    id: int
    spec: RequestSpec
    choice: SaltChoice
    view: RequestView
    decision: Decision | None = None
    expected_cached_tokens: int = 0
    indexed_blocks: int = 0
    """Leading blocks the prefix index held on its replica when it was placed (before its own)."""
    weight_version: int | None = None
    version_mark: int = 0
    chosen_under: tuple[int | None, str] = (None, "")
    """The fleet's current version and update policy when ``choice`` was made
    (``DecisionCore._rechoose``)."""
    tried: list[ReplicaId] = field(default_factory=list)
    suspects: list[ReplicaId] = field(default_factory=list)
    """Replicas that answered it with an error (``retry``): a failure of each is counted only if
    it then succeeds on another one. A request every replica fails (vLLM answered HTTP 500 to
    ``top_k: 1e30``) is the request's fault: counted, three of them took a whole fleet out of
    rotation (a fresh user's report)."""
    admission: Admission | None = None
    queued: AdmissionRequest | None = None
    undo_pins: dict[str, ReplicaId | None] = field(default_factory=dict)
    move_to: ReplicaId | None = None
    """A replica that joined with room while the job waited in another's queue
    (``DecisionCore._offer_joined``): its next placement considers that replica alone, if it
    is still eligible then."""
    incarnation: int = 0
    """Its replica's incarnation when it was placed (``ReplicaRecord.incarnation``): a placement
    undone after that replica restarted, or left and came back under its id, is not taken out of
    the new one's bookkeeping (the requests it was sent, its index)."""
    done: bool = False
    abandoned: int = 0
    """Times it was taken back from a replica found stalled or hung (``abandoned``): not
    failures of the request, so the router bounds them apart from its connection retries."""
    answering: int = 0
    """Once its answer reaches its client (``DecisionCore.answering``; it runs nowhere else
    then, and nothing takes it back: ``router.lifecycle.Flight.answering``): the engine requests
    it counts in its replica's ``ReplicaRecord.answering`` (unless that replica restarted or
    left since its dispatch)."""
    generated_tokens: int | None = None
    """Tokens the engine generated for it, when the answer said (``usage.completion_tokens``,
    a stream's relayed count); set by the caller before ``finish``. Unset, the core assumes
    every token ``spec.new_tokens`` allowed (the free-queue model then errs low)."""

    @property
    def salt(self) -> str | None:
        return self.choice.salt

    @property
    def replica_id(self) -> ReplicaId | None:
        return self.decision.replica_id if self.decision is not None else None

    @property
    def ticket(self):
        return self.admission.ticket if self.admission is not None else None


class DecisionCore:
    """See the module docstring. Not thread-safe; every method is microseconds-scale
    except ``expire`` sweeps (amortized, at most once per ``now`` second)."""

    def __init__(self, cfg: PolicyConfig, *, policy: str = "prefix_affinity", seed: int = 0,
                 weight_update_policy: WeightUpdatePolicy = "keep+salt", initial_version: int | None = 0,
                 admission: bool = True) -> None:
        self.cfg = cfg
        self.registry = KeyRegistry(cfg.max_pins, cfg.key_ttl_s)
        self.policy = make_policy(policy, cfg, random.Random(seed), pins=self.registry)
        self.admission = AdmissionState(cfg, self.registry, enabled=admission)
        self.versions = VersionBook(weight_update_policy, initial_version)
        self.free_queue = FreeQueueModel()
        """Which cached blocks survive until a request is scheduled (the expected-cached count)."""
        self.replicas: dict[ReplicaId, ReplicaRecord] = {}
        self._jobs: dict[str, Job] = {}
        self._outbox: list[tuple[Job, Admission]] = []
        self._unheld: list[Job] = []
        """Jobs admitted whose prompt blocks have not yet left the free-queue model (:meth:`settle`)."""
        self._taken_out: list[tuple[ReplicaId, Outcome, int]] = []
        self._next_id = 0
        self._swept_at = float("-inf")
        self._views: dict[ReplicaId, ReplicaView] = {}
        """Each replica's view for the policies (:meth:`_views_of`), rebuilt only once one of its
        inputs changed: the replicas in ``_changed`` (records, versions, peers: this class), in
        the ledger's ``changed`` (requests in flight) and the queue's (requests queued)."""
        self._changed: set[ReplicaId] = set()
        self._ledger_changed, self._queue_changed = self.admission.ledger.changed, self.admission.queue.changed
        self._queued = self.admission.queue.requests_by_replica  # a live Counter, read-only here
        self._block_size: int | None = None
        self._joined: dict[ReplicaId, ReplicaView | None] = {}
        """Replicas that joined and are offered the queued work they could start
        (:meth:`_offer_joined`), each with its view at the last offer (the queue is scanned again
        only once that view changed)."""
        self._incarnations = itertools.count(1)
        """Numbers each replica's joining and each restart (``ReplicaRecord.incarnation``)."""

    # -- replica events -------------------------------------------------------------------------

    def add_replica(self, rid: ReplicaId, *, block_size: int, num_gpu_blocks: int = 0,
                    scoring_cap: bool = False, version: int | None = None) -> None:
        """A replica joined (or came back under ``rid`` with a new endpoint: call
        ``restarted`` instead to forget its cache). ``version`` defaults to the initial one."""
        if self.replicas and block_size != self.block_size:
            raise ValueError(f"replica {rid} has block_size {block_size}, the fleet {self.block_size}; "
                             "configure one block size")
        self.replicas[rid] = ReplicaRecord(rid, block_size, num_gpu_blocks, scoring_cap,
                                           incarnation=next(self._incarnations))
        self._block_size = block_size
        self._changed.add(rid)
        self.versions.set_loaded(rid, self.versions.initial if version is None else version)
        self.admission.queue.replicas = len(self.replicas)
        self.policy.on_replicas_changed(list(self.replicas))
        self._joined[rid] = None

    def remove_replica(self, rid: ReplicaId, now: float) -> None:
        """``rid`` left: its pins, index entries and versions go; jobs queued for it come back
        from ``pump`` as ``replica_gone``."""
        self._settle_holds()
        self._drop_queue(rid)
        self.replicas.pop(rid, None)
        self._views.pop(rid, None)
        self.registry.drop_replica(rid)
        self.versions.forget_replica(rid)
        self.admission.ledger.forget_replica(rid)
        self.free_queue.remove_replica(rid)
        self.admission.forget_replica(rid)
        self.admission.queue.replicas = len(self.replicas)
        self.policy.on_replicas_changed(list(self.replicas))

    def restarted(self, rid: ReplicaId, *, num_gpu_blocks: int = 0, scoring_cap: bool = False) -> None:
        """``rid`` came back with an empty cache: forget its index entries and pins. It started
        from the replicas' model, so it serves the initial version, whatever it had loaded (a
        fresh attacker saw a restarted replica's answers name the update it no longer served;
        ``router.weights.updater.WeightUpdater.catch_up`` brings it to the current one). Like
        every replica event here, ignored for a replica the core does not hold (it left meanwhile)."""
        self._settle_holds()
        rec = self.replicas.get(rid)
        if rec is None:
            return
        rec.num_gpu_blocks, rec.scoring_cap, rec.load = num_gpu_blocks, scoring_cap, ReplicaLoad()
        rec.progress_at, rec.busy, rec.stalls, rec.stalled_until, rec.answering = None, False, 0, None, 0
        rec.checked_at, rec.probing, rec.suspect = None, False, False
        rec.incarnation = next(self._incarnations)
        self._changed.add(rid)
        self.policy.on_cache_reset(rid)
        self.free_queue.reset(rid)
        self.admission.forget_replica(rid)
        self.registry.drop_replica(rid)
        self.versions.set_loaded(rid, self.versions.initial)
        self.versions.cache_reset(rid)

    def set_health(self, rid: ReplicaId, healthy: bool) -> None:
        """Health from a scrape or a failed dispatch; an unhealthy replica's queue comes back."""
        rec = self.replicas.get(rid)
        if rec is None:
            return
        was = self._in_service(rid)
        rec.healthy = healthy
        self._changed.add(rid)
        self._service_changed(rid, was)
        if healthy:
            rec.failures = 0
        else:
            self._drop_queue(rid)

    def observe_load(self, rid: ReplicaId, load: ReplicaLoad, scrape_started_at: float) -> None:
        """A scrape that began at ``scrape_started_at`` shows every request admitted before it; it
        also tells whether the engine makes progress (:meth:`stalled`)."""
        rec = self.replicas.get(rid)
        if rec is not None:
            self._watch_progress(rec, load, scrape_started_at)
            rec.load = load
            self._changed.add(rid)
            self.admission.ledger.scraped(rid, scrape_started_at)

    def _watch_progress(self, rec: ReplicaRecord, load: ReplicaLoad, now: float) -> None:
        """The stall rule (``PolicyConfig.stall_timeout_s``) at one scrape. Finished tokens that
        moved end a stall at once; holding work with none moving for the timeout starts one, for
        the timeout, doubled for each stall in a row without progress since (at most 8 timeouts):
        an engine hung while idle shows no work once its requests are taken back, so it comes
        back after its stall and the next request sent there tells whether it still hangs (a
        half-open breaker), less often each time."""
        rid, timeout = rec.replica_id, self.cfg.stall_timeout_s
        moved = load.finished_tokens != rec.load.finished_tokens
        if moved:
            rec.stalls, rec.stalled_until, rec.suspect = 0, None, False
        if moved or rec.checked_at is None:
            rec.checked_at = now
        if rec.progress_at is None or not rec.busy or moved or rid in self.versions.rotation:
            rec.progress_at = now
        # an engine hung while idle still shows its last numbers (vLLM updates them from engine
        # steps): the requests this router has in flight there count as held work too
        # (not those answering: their tokens are made, and a client reading a finished stream
        # slowly keeps it in flight; were the engine hung mid-answer, its gauges would show it)
        rec.busy = (load.num_running + load.num_waiting > 0 or self.admission.ledger.count(rid) > rec.answering
                    or rec.probing)
        if (timeout > 0 and rec.busy and now - rec.progress_at >= timeout and rid not in self.versions.rotation
                and (rec.stalled_until is None or now >= rec.stalled_until)):
            rec.stalls += 1
            rec.stalled_until = now + timeout * min(2 ** (rec.stalls - 1), MAX_STALL_TIMEOUTS)
            rec.suspect = True

    def stalled(self, rid: ReplicaId, now: float) -> bool:
        """Whether ``rid``'s engine is stalled at ``now``: by the scrapes given to
        :meth:`observe_load`, it held requests for ``policy.stall_timeout_s`` seconds without
        finishing a token of any (a hung engine behind a live API server), and neither has a
        token moved since nor its stall ended (:meth:`_watch_progress`). With probes on
        (``policy.stall_probe_after_s``) a stall ends only when a token moves or a probe is
        answered (:meth:`probe_ended`): once its time is up the replica is probed
        (:meth:`probe_due`), and no client's request is sent to an engine still hung (without
        probes the next request sent there tells, a half-open breaker). False for an unknown
        replica, one in a weight update (out of rotation: its engine is paused on purpose), or
        with the rule off (``stall_timeout_s`` 0)."""
        rec = self.replicas.get(rid)
        return (rec is not None and rec.stalled_until is not None
                and (now < rec.stalled_until or (rec.suspect and self.cfg.stall_probe_after_s > 0))
                and self.cfg.stall_timeout_s > 0 and rid not in self.versions.rotation)

    def answering(self, job: Job) -> None:
        """The first byte of ``job``'s answer is going to its client (``router.lifecycle``): its
        engine has seen it and made its tokens, and it runs nowhere else now. From here on it no
        longer counts as work the engine holds for the stall rule (:meth:`_watch_progress`):
        a healthy engine whose finished stream a client reads slowly is not stalled. Idempotent."""
        if job.answering or job.ticket is None:
            return
        job.answering = job.ticket.requests
        rid = job.replica_id
        rec = self.replicas.get(rid) if rid is not None else None
        if rec is not None and rec.incarnation == job.incarnation:  # else finish takes nothing off either
            rec.answering += job.answering

    def probe_due(self, rid: ReplicaId, now: float) -> bool:
        """Whether the router should probe ``rid``'s engine now: in rotation, no work held at the
        last scrape, no probe in flight, and either in service with no token finished for
        ``policy.stall_probe_after_s`` (an engine hung while idle shows its last numbers and
        answers ``/health``: only work sent to it tells), or at the end of a stall that neither a
        token nor a probe ended yet (``ReplicaRecord.suspect``: the probe, not a client's request,
        tells whether it still hangs). False with the stall rule off, or the probe's setting 0.
        Send it, then :meth:`probe_sent`; :meth:`probe_ended` once it ends."""
        rec = self.replicas.get(rid)
        after = self.cfg.stall_probe_after_s
        if (rec is None or after <= 0 or self.cfg.stall_timeout_s <= 0 or rec.busy or rec.probing
                or rid in self.versions.rotation):
            return False
        if rec.suspect:
            return rec.stalled_until is not None and now >= rec.stalled_until
        return rec.healthy and rec.checked_at is not None and now - rec.checked_at >= after

    def probe_sent(self, rid: ReplicaId, now: float) -> None:
        """A probe is in flight on ``rid`` since ``now``: work the engine holds for the stall rule,
        so an engine that never finishes it stalls (:meth:`stalled`) as one holding a client's
        request would."""
        rec = self.replicas.get(rid)
        if rec is not None:
            rec.probing = rec.busy = True
            rec.checked_at = now

    def probe_ended(self, rid: ReplicaId, answered: bool | None) -> None:
        """The probe on ``rid`` ended. ``answered``: True when the engine answered it (HTTP 200:
        it finished a token, so a stall ends now, before the next scrape shows the counters
        move); False when it got no answer in time (still hung: the stall stands); None when it
        tells nothing of the engine (the server refused it, or the connection failed: the stall
        ends at its time and the next request sent there tells, as without probes).
        Idempotent; ignored for a replica that left."""
        rec = self.replicas.get(rid)
        if rec is None:
            return
        rec.probing = False
        if answered:
            rec.stalls, rec.stalled_until, rec.suspect = 0, None, False
        elif answered is None:
            rec.suspect = False

    def restart_due(self, rid: ReplicaId, now: float) -> bool:
        """Whether ``rid`` is stalled at ``now`` for the ``policy.stall_restart_after``-th time in
        a row (no token finished between the stalls): its engine hung for good, and a supervisor
        that can should restart it (``router.scrape``). False with the rule off (0)."""
        rec = self.replicas.get(rid)
        after = self.cfg.stall_restart_after
        return rec is not None and after > 0 and rec.stalls >= after and self.stalled(rid, now)

    def cache_reset(self, rid: ReplicaId) -> None:
        """``rid``'s prefix cache was emptied (a confirmed reset): predict no hits there; its
        cache now holds KV of its loaded version only."""
        if rid not in self.replicas:
            return
        self._settle_holds()
        self.policy.on_cache_reset(rid)
        self.free_queue.reset(rid)
        self.admission.forget_replica(rid)
        self.versions.cache_reset(rid)

    def version_loaded(self, rid: ReplicaId, version: int | None) -> None:
        """``rid`` now serves ``version`` (None: unknown, after a failed reload); ignored once ``rid``
        left (a late report would list it in the version book and the shared snapshot again)."""
        if rid not in self.replicas:
            return
        self.versions.set_loaded(rid, version)
        self._changed.add(rid)

    def finish_update(self, version: int, policy: WeightUpdatePolicy) -> None:
        """An update to ``version`` under ``policy`` reached at least one replica."""
        self.versions.finish_update(version, policy)

    def set_rotation(self, rid: ReplicaId, reason: str | None) -> None:
        """Take ``rid`` out of rotation for ``reason``, or (None) put it back. Jobs queued for
        ``rid`` come back from ``pump`` as ``replica_gone`` (placed again: a weight update must
        not find them admitted to a paused engine, nor run them on weights they were not salted for)."""
        was = self._in_service(rid)
        if reason is None:
            self.versions.rotation.pop(rid, None)
        elif rid not in self.replicas:  # it left: out of rotation for good (an "updating" would stick)
            return
        else:
            self.versions.rotation[rid] = reason
            self._drop_queue(rid)
        self._service_changed(rid, was)

    def _in_service(self, rid: ReplicaId) -> bool:
        """Whether ``rid`` is here, healthy and in rotation."""
        rec = self.replicas.get(rid)
        return rec is not None and rec.healthy and rid not in self.versions.rotation

    def _service_changed(self, rid: ReplicaId, was: bool) -> None:
        """Tell the policy when ``rid`` went out of service or came back (``Policy.on_service``)."""
        now = self._in_service(rid)
        if now != was:
            self.policy.on_service(rid, now)

    def adopt_pin(self, kind: str, key: str | None, rid: ReplicaId | None,
                  start_version: int | None = None, now: float | None = None) -> None:
        """Another router pinned ``key`` to ``rid`` (shared state): follow it if ``rid`` is ours.
        ``start_version``: the version ``key`` started under there (keep+salt keeps it here too);
        ``now``: the caller's clock (the adopted record counts as touched then)."""
        if key is None or kind not in ("session", "group"):
            return
        if now is not None:
            self.registry.advance(now)
        if start_version is not None:
            self.registry.touch(kind, key).start_version = start_version  # type: ignore[arg-type]
        if rid is None or rid not in self.replicas:
            return
        rec = self.registry.get(kind, key)  # type: ignore[arg-type]
        if rec is None or rec.replica != rid:
            self.registry.record(kind, key, rid)  # type: ignore[arg-type]

    def end_session(self, session_id: str) -> bool:
        """The client ended ``session_id``: its pin and parked prefix are released at once, and a
        parked prefix is a sample of the size sessions end at (``AdmissionState.session_blocks``).
        False when this router holds no record of it (never seen, already ended, or expired)."""
        self._settle_holds()
        rec = self.registry.record_of("session", session_id)
        if rec is not None and rec.parked is not None and not rec.ended:
            self.admission.session_ended(rec.parked[1])
            rec.end_sampled = True  # a turn still running through the end does not sample again
        return self.registry.end("session", session_id)

    # -- sharing with other routers (cache_policy.sharing; router.state carries it out) ---------

    def versions_snapshot(self) -> sharing.VersionSnapshot:
        """Versions, policy and update rotation, to share (``cache_policy.sharing``)."""
        return sharing.versions_snapshot(self.versions)

    def apply_versions(self, snapshot: sharing.VersionSnapshot) -> list[ReplicaId]:
        """Adopt another router's version snapshot; the replicas whose loaded version changed.
        Placements waiting on rotation should be woken by the caller."""
        self._changed.update(self.replicas)  # loaded versions may change under any replica
        was = {rid: self._in_service(rid) for rid in self.replicas}  # rotation may change too
        moved = sharing.apply_versions(self.versions, snapshot, list(self.replicas))
        for rid, before in was.items():
            self._service_changed(rid, before)
        return moved

    def unconfirm_versions(self) -> None:
        """Versions could not be confirmed (shared state unreachable at start): salt nothing
        with a guess until ``apply_versions`` (``cache_policy.sharing.unconfirmed``)."""
        sharing.unconfirmed(self.versions)
        self._changed.update(self.replicas)

    def set_peer_loads(self, loads: dict[ReplicaId, sharing.PeerLoad]) -> None:
        """Other routers' in-flight shares per replica (replacing the last ones); admission and
        placement count them beside this router's own."""
        ledger = self.admission.ledger
        self._changed.update(ledger.peers)
        ledger.peers = {rid: load for rid, load in loads.items() if rid in self.replicas}
        self._changed.update(ledger.peers)

    def own_loads(self) -> dict[ReplicaId, sharing.PeerLoad]:
        """This router's in-flight share per replica, as other routers fold it in."""
        ledger = self.admission.ledger
        return {rid: sharing.PeerLoad(ledger.count(rid), ledger.committed(rid), ledger.unseen(rid))
                for rid in self.replicas}

    def pin_by_hash(self, kind: str, key: str | None, now: float) -> ReplicaId | None:
        """Shared state is unreachable: pin ``key``, if it has no pin here, to its rendezvous
        replica among the healthy ones in rotation (``cache_policy.sharing.rendezvous``), so
        routers that cannot coordinate still agree. Returns the key's pin (None: no replica)."""
        if key is None:
            return None
        rec = self.registry.get(kind, key)  # type: ignore[arg-type]
        if rec is not None and rec.replica in self.replicas:
            return rec.replica
        usable = sorted(rid for rid, r in self.replicas.items() if r.healthy and rid not in self.versions.rotation)
        rid = sharing.rendezvous(f"{kind}:{key}", usable)
        if rid is not None:
            self.adopt_pin(kind, key, rid, now=now)
        return rid

    def pins(self) -> list[tuple[str, str, ReplicaId, int | None]]:
        """Every pin: ``(kind, key, replica, start_version)`` (to re-publish to shared state)."""
        return self.registry.pins()

    def follow_pin(self, job: Job, rid: ReplicaId, now: float) -> Decision | None:
        """Another router won the pin of ``job``'s session or group (first writer wins): move the
        placed, not yet admitted ``job`` there, pins included. Returns the new decision, or None
        when ``rid`` cannot take it (unknown, unhealthy, out of rotation, not serving the job's
        version, already tried): the job then keeps its own placement."""
        assert job.decision is not None and job.admission is None, "bug: follow_pin() needs a placed, unadmitted job"
        if rid == job.replica_id:
            return job.decision
        if rid not in {v.replica_id for v in self._candidates(job) if v.healthy}:
            return None
        self.policy.on_finished(job.view, job.decision.replica_id)
        self._undo(job)
        job.decision = None
        for kind, key in (("session", job.spec.session_id), ("group", job.spec.group_id)):
            if key is not None:
                self.registry.record(kind, key, rid)  # type: ignore[arg-type]
        decision = self.place(job, now, only=rid)
        if decision is None:  # cannot happen for an eligible replica; never leave the job unplaced
            self.place(job, now)
        return decision

    # -- the request lifecycle ------------------------------------------------------------------

    @property
    def block_size(self) -> int:
        """The fleet's KV block size in tokens (every replica has the same; kept when the last
        replica leaves, for the jobs still running then). ValueError before any replica joined."""
        if self._block_size is None:
            raise ValueError("no replica: add one before routing")
        return self._block_size

    def open(self, spec: RequestSpec, now: float) -> Job:
        """Start a job: its salt and version (recording a new key's start version) and hashes."""
        self.registry.advance(now)
        self._sweep(now)
        if spec.session_id is not None:
            self.registry.reopen("session", spec.session_id)
        choice = self.versions.assign(self.registry, spec.session_id, spec.group_id, spec.weight_version,
                                      spec.tenant, scoring=spec.kind == "score")
        hashes = tuple(block_hashes(spec.token_ids, self.block_size, choice.salt))
        view = RequestView(hashes, len(spec.token_ids), spec.session_id, spec.group_id, spec.kind,
                           spec.weight_version, spec.fan_out)
        self._next_id += 1
        job = Job(self._next_id, spec, choice, view)
        job.chosen_under = (self.versions.current, self.versions.policy)
        return job

    def place(self, job: Job, now: float, *, only: ReplicaId | None = None) -> Decision | None:
        """Choose a replica for ``job`` and record it; None when no replica is eligible now
        (all unhealthy, out of rotation, or already tried by this job). ``only``: consider
        that replica alone (``follow_pin``)."""
        self._settle_holds()
        assert job.decision is None and not job.done, "bug: place() on a placed or finished job"
        self.registry.advance(now)
        self._rechoose(job)
        self._settle_version(job)
        candidates = self._candidates(job)
        target, job.move_to = job.move_to, None
        if only is None and target is not None and any(v.replica_id == target and v.healthy for v in candidates):
            only = target  # it was moved out of a queue to a replica that joined with room
        if only is not None:
            candidates = [v for v in candidates if v.replica_id == only]
        decision = self.policy.select(job.view, candidates)
        if decision is None:
            return None
        if self._new_session_without_room(job, decision, now):
            roomy = [v for v in candidates if not self.admission.sessions_full(v, now)]
            decision = (self.policy.select(job.view, roomy) if roomy else None) or decision
        job.undo_pins = self._pins_before(job)
        job.incarnation = self.replicas[decision.replica_id].incarnation
        self.policy.on_routed(job.view, decision)
        rid = decision.replica_id
        job.indexed_blocks = decision.matched_blocks
        self._set_expected(job, decision, decision.matched_blocks)
        job.weight_version = self.versions.loaded.get(rid)
        job.version_mark = self.versions.mark(rid)
        return job.decision

    def _new_session_without_room(self, job: Job, decision: Decision, now: float) -> bool:
        """Whether ``decision`` sends a session with nothing cached anywhere (``LOAD``) to a replica
        whose session share is full (``AdmissionState.sessions_full``): it would wait there for
        one of that replica's sessions to end while another replica could start it now. Then
        :meth:`place` chooses again among the replicas with room (``bench.sim`` 64 replicas,
        ws/kv 2, mixed: makespan 164 s -> 162 s, busiest/mean requests 1.21 -> 1.08, prefilled
        1.088 -> 1.062 of ideal, with requests sent then breaking load ties: ``cache_policy.sent``)."""
        return (decision.reason is RouteReason.LOAD and job.spec.session_id is not None
                and self.admission.sessions_full(self._view(decision.replica_id), now))

    def admit(self, job: Job, now: float) -> Admission:
        """Ask for room on the placed replica: admit (``job.ticket``), queue or reject (the job
        is then finished: un-indexed and unpinned); ``replica_gone`` when that replica left since
        :meth:`place` (the job is unplaced: place it again)."""
        self._settle_holds()
        assert job.decision is not None, "bug: admit() before place()"
        rid = job.decision.replica_id
        if rid not in self.replicas:  # it left since place (a router awaiting Redis between them)
            return self._replica_gone(job, rid)
        total = self._footprint(job)
        request = self.admission.request(rid, total, job.decision.matched_blocks, job.spec.session_id,
                                         job.spec.group_id, job.spec.fan_out, now, str(job.id),
                                         job.view.num_prompt_tokens // self.block_size)
        self._expire(now)
        adm, displaced = self.admission.ask(request, self._view(rid), now, self.free_queue.freed(rid))
        for victim in displaced:
            self._refuse(self._jobs.pop(victim.request_id), "displaced", now)
        job.admission = adm
        if adm.verdict == "admit":
            self._unheld.append(job)  # settle() holds its blocks once it is on its way
        elif adm.verdict == "queue":
            job.queued = request
            self._jobs[str(job.id)] = job
        elif adm.verdict == "reject":
            self.finish(job, "refused", now)
        return adm

    def has_decisions(self) -> bool:
        """Whether :meth:`pump` has jobs to decide or decided ones to hand out (else it would
        only run the amortized idle sweep, which any later pump runs)."""
        return bool(self._jobs or self._outbox)

    def pump(self, now: float) -> list[tuple[Job, Admission]]:
        """Jobs whose admission was decided since the last call: queued jobs admitted now, and
        jobs refused (``reject``: timeout / displaced) or sent back (``replica_gone``). Also runs the
        amortized sweep (idle key records, unconfirmed predictions), so a router with no requests
        (its scrape rounds pump) lets go of what expired."""
        self.registry.advance(now)
        self._sweep(now)
        if self._joined:
            self._offer_joined(now)
        if not self._jobs and not self._outbox:  # nothing queued (most calls): the amortized sweep alone
            if self._unheld and self.admission.unpark_due(now):
                self._settle_holds()  # the sweep reads parked prefixes, which a hold may touch
            self.admission.unpark_idle(now)
            return []
        self._settle_holds()
        self._expire(now)
        waiting = {r.replica_id for r in self.admission.queue.waiting()}  # only their views are needed
        views = self._views_of([rid for rid in waiting if rid in self.replicas and self.replicas[rid].healthy
                                and rid not in self.versions.rotation])
        freed = {v.replica_id: self.free_queue.freed(v.replica_id) for v in views}
        for request, adm in self.admission.pump(views, now, freed):
            self._admitted_from_queue(request, adm, now)
        out, self._outbox = self._outbox, []
        return out

    def _admitted_from_queue(self, request: AdmissionRequest, adm: Admission, now: float) -> None:
        job = self._jobs.pop(request.request_id)
        job.queued, job.admission = None, adm
        self._refresh_expected(job, now)  # evictions seen while it waited (KV events) count
        self._hold(job)
        self._outbox.append((job, adm))

    def _hold(self, job: Job) -> None:
        """``job`` was admitted: its prompt blocks leave its replica's free queue (the hits among
        them move older parked prefixes toward the tail, ``AdmissionState.touched``)."""
        rid = job.decision.replica_id
        self.admission.touched(rid, self.free_queue.hold(rid, job.view.block_hashes))

    def finish(self, job: Job, outcome: Outcome, now: float) -> None:
        """``job`` ended as ``outcome`` (see :data:`Outcome`). Idempotent for a finished job.

        ``down``, ``unreachable`` and ``retry`` leave the job open: place it again (its ``tried`` list grows)."""
        self._settle_holds()
        if job.done:
            return
        self.registry.advance(now)
        if job.queued is not None:
            self.admission.queue.remove(job.queued)
            self._jobs.pop(str(job.id), None)
            job.queued = None
        rid = job.replica_id
        if rid is not None:
            self.policy.on_finished(job.view, rid)
            if job.answering:
                rec = self.replicas.get(rid)
                if rec is not None and rec.incarnation == job.incarnation:
                    rec.answering -= job.answering
                job.answering = 0
            if job.ticket is not None:
                capacity = self._raw_view(rid).num_gpu_blocks if rid in self.replicas else 0
                generated = job.spec.new_tokens if job.generated_tokens is None else job.generated_tokens
                if capacity:
                    self._note_low(rid, job, generated, capacity)
                self.admission.release(job.ticket, now, park=outcome == "ok", capacity=capacity,
                                       stamp=self.free_queue.freed(rid),
                                       ends_session=outcome == "ok" and job.spec.ends_session)
                full = (job.view.num_prompt_tokens + generated) // self.block_size  # a partial block goes to the head
                self.free_queue.release(rid, job.view.block_hashes, full, capacity,
                                        prefilled=outcome not in ("refused", "down", "unreachable"))
            if outcome in ("refused", "down", "unreachable") or (outcome == "cancelled" and job.ticket is None):
                self._undo(job)
            if outcome == "retry":
                job.suspects.append(rid)
            else:
                self._count_failure(rid, outcome)
        if outcome in ("down", "unreachable", "retry", "abandoned", "preempted") and rid is not None:
            if outcome != "preempted":
                job.tried.append(rid)
            job.abandoned += outcome == "abandoned"
            job.decision, job.admission = None, None
            return
        job.done = True
        if outcome == "ok":  # it ran elsewhere: those that failed it are to blame
            for suspect in job.suspects:
                self._count_failure(suspect, "retry")
        if job.spec.session_id is not None:
            if outcome == "ok" and job.spec.ends_session:
                self.registry.end("session", job.spec.session_id)  # its release above took the sample
            # ended while it waited or ran (a DELETE; also its own X-Session-End then): forget it now
            self.registry.drop_ended("session", job.spec.session_id)

    def dispatchable(self, job: Job) -> bool:
        """Whether the admitted ``job`` may be sent now: its replica is still in rotation and
        serves the version it was placed for (a weight update may have begun while it waited
        on shared state). False: finish it ``preempted`` and place it again."""
        rid = job.replica_id
        if rid is None or rid in self.versions.rotation:
            return False
        return self.versions.loaded.get(rid) == job.weight_version

    def kv_versions(self, job: Job) -> list[int]:
        """Versions whose weights computed the KV ``job`` may reuse on its replica
        (``VersionBook.kv_versions``: ascending, each once); [] before it is placed."""
        rid = job.replica_id
        return self.versions.kv_versions(rid, job.choice) if rid is not None else []

    def too_stale(self, requested: int | None, max_staleness: int | None) -> bool:
        """A request tagged ``requested`` is more than ``max_staleness`` versions behind the
        current one (``VersionBook.too_stale``; answer 409 naming both)."""
        return self.versions.too_stale(requested, max_staleness)

    def _rechoose(self, job: Job) -> None:
        """A job whose salt was chosen before a weight update (placed again after a preemption,
        or after waiting in a queue across the update) takes the salt the present version and
        policy give it, as if it arrived now: its tokens will be computed by the new weights, and
        a choice made under ``flush`` (unsalted, the caches reset at each update) would reuse, under
        a later ``keep``, ``salt`` or ``keep+salt``, the old weights' KV (a fresh attacker's scores
        were 4.7 nats off both weight sets). A strict job (its own version pinned) keeps its
        choice; :meth:`_settle_version` moves it when its version is gone."""
        now_under = (self.versions.current, self.versions.policy)
        if job.chosen_under == now_under or job.choice.pins_version:
            return
        spec = job.spec
        choice = self.versions.assign(self.registry, spec.session_id, spec.group_id, spec.weight_version,
                                      spec.tenant, scoring=spec.kind == "score")
        job.chosen_under = now_under
        if choice != job.choice:
            job.choice = choice
            job.view = msgspec.structs.replace(job.view, block_hashes=tuple(block_hashes(spec.token_ids, self.block_size,
                                                                                        choice.salt)))

    def _settle_version(self, job: Job) -> None:
        """A strict job (``choice.pins_version``) whose version no eligible replica serves is
        re-salted for the newest version one serves, so no token of it is computed by one
        version's weights over another's KV (README "Version contract")."""
        choice = job.choice
        if not choice.pins_version:
            return
        loaded, rotation = self.versions.loaded, self.versions.rotation
        eligible: set[int] = set()
        for rid, rec in self.replicas.items():  # stops at the first eligible replica serving it
            if rec.healthy and rid not in rotation and rid not in job.tried:
                version = loaded.get(rid)
                if version == choice.version:
                    return
                if version is not None:
                    eligible.add(version)
        if not eligible:
            return
        new = self.versions.choice_for(max(eligible), job.spec.tenant)
        # a key whose start this job's version set moves with it; scoring never inherits a
        # session's start (VersionBook.assign), so it never moves one (a fresh attacker's score
        # tagged with its session's start re-based the session, whose next turn lost its prefix)
        keys = () if job.spec.kind == "score" else (("session", job.spec.session_id), ("group", job.spec.group_id))
        for kind, key in keys:
            rec = self.registry.record_of(kind, key) if key is not None else None  # type: ignore[arg-type]
            if rec is not None and rec.start_version == choice.version:
                rec.start_version = new.version
        job.choice = new
        job.view = msgspec.structs.replace(job.view, block_hashes=tuple(block_hashes(job.spec.token_ids, self.block_size, new.salt)))

    def _refresh_expected(self, job: Job, now: float) -> None:
        """Evictions seen while ``job`` waited count; its own predicted entries (inserted when it
        was placed) do not: the index match is capped by the one at placement."""
        index = self.prefix_index()
        if index is None or job.decision is None:
            return
        matched = index.match(job.view.block_hashes, now).get(job.decision.replica_id, 0)
        self._set_expected(job, job.decision, min(matched, job.indexed_blocks))

    def _set_expected(self, job: Job, decision: Decision, matched: int) -> None:
        """Record ``decision`` with the blocks ``job`` should find cached: of the ``matched``
        leading blocks the index holds on its replica, those vLLM will not recompute (the last
        prompt token always is) and will not have evicted when ``job`` is scheduled
        (:class:`~cache_policy.free_queue.FreeQueueModel`, if the replica's size is known)."""
        rid = decision.replica_id
        matched = min(matched, max(0, (job.view.num_prompt_tokens - 1) // self.block_size))
        if matched:
            view = self._raw_view(rid)
            if view.num_gpu_blocks:
                free_final = int(view.num_gpu_blocks - 1 - running_blocks(view, self.admission.ledger))  # - the null block
                matched = self.free_queue.surviving(rid, job.view.block_hashes, matched, free_final)
        job.decision = decision if decision.matched_blocks == matched else msgspec.structs.replace(decision, matched_blocks=matched)
        job.expected_cached_tokens = matched * self.block_size

    def _note_low(self, rid: ReplicaId, job: Job, generated: int, capacity: int) -> None:
        """``job`` (still in the ledger) is about to release its blocks on ``rid``: record the
        free queue's low point just before (``FreeQueueModel.note``): the work in flight at its
        peak, less what ``job`` never reached (its peak counts ``new_tokens``; it generated
        ``generated``, each of its ``fan_out`` samples with a partial block at most)."""
        prompt, ledger = job.view.num_prompt_tokens, self.admission.ledger
        unused = max(0, blocks_needed(prompt + job.spec.new_tokens, 0, self.block_size)
                     - blocks_needed(prompt + generated, 0, self.block_size) - job.spec.fan_out)
        unseen = job.ticket is not None and ledger.is_unseen(job.ticket)  # its peak is in the unseen sum too
        held = running_blocks(self._raw_view(rid), ledger, unused, unused if unseen else 0)
        self.free_queue.note(rid, int(capacity - 1 - held), capacity)  # - the null block

    def _footprint(self, job: Job) -> int:
        """Blocks ``job`` holds on its replica at its peak (prompt + every token it may generate)."""
        return blocks_needed(job.view.num_prompt_tokens + job.spec.new_tokens, 0, self.block_size)

    def _count_failure(self, rid: ReplicaId, outcome: Outcome) -> None:
        """Consecutive dispatch failures of ``rid``: one bad connection is not a dead replica."""
        rec = self.replicas.get(rid)
        if rec is None:
            return
        if outcome in ("ok", "refused"):
            rec.failures = 0
        elif outcome in ("down", "unreachable", "retry", "failed"):
            rec.failures += 1
            if rec.healthy and (outcome == "down" or rec.failures >= self.cfg.failures_out_of_rotation):
                self.set_health(rid, False)
                self._taken_out.append((rid, outcome, rec.failures))

    def taken_out(self) -> list[tuple[ReplicaId, Outcome, int]]:
        """Replicas this core took out of rotation for failed dispatches since the last call:
        ``(replica, last outcome, failures in a row)``, for the router to log and count (a scrape
        that reaches the replica puts it back)."""
        out, self._taken_out = self._taken_out, []
        return out

    def refuse_queued(self, reason: str, now: float) -> None:
        """Refuse every queued job (``reject`` with ``reason``, e.g. the router is shutting down);
        ``pump`` returns them."""
        for request in list(self.admission.queue.waiting()):
            self.admission.queue.remove(request)
            self._refuse(self._jobs.pop(request.request_id), reason, now)

    # -- reading the state ----------------------------------------------------------------------

    def replica_view(self, rid: ReplicaId) -> ReplicaView:
        """``rid`` as admission projects it (``kv_cache_usage`` = projected usage)."""
        return project(self._raw_view(rid), self.admission.ledger, self.registry)

    def in_flight(self, rid: ReplicaId) -> int:
        """Engine requests admitted to ``rid`` and not finished (a fan-out counts K)."""
        return self.admission.ledger.count(rid)

    def in_flight_all(self, rid: ReplicaId) -> int:
        """Engine requests on ``rid`` from this router and, as last shared, every other one
        (what a weight update drains before it pauses the engine)."""
        return self.admission.ledger.count(rid) + self.admission.ledger.peer(rid).requests

    def versions_since(self, job: Job) -> list[int]:
        """Versions ``job``'s replica served from its dispatch until now."""
        rid = job.replica_id
        return self.versions.versions_since(rid, job.version_mark) if rid is not None else []

    def settle(self) -> None:
        """Apply the bookkeeping :meth:`place` and :meth:`admit` deferred: the prefix index's
        insert of the placed prompt (``PrefixIndex.insert(defer=True)``) and the admitted prompt's
        blocks leaving the free-queue model (``FreeQueueModel.hold``). Never needed for
        correctness (every method that reads them settles first); a router calls it once the
        request is on its way to the replica, so the work overlaps the replica's prefill instead
        of delaying the send."""
        self._settle_holds()
        index = self.prefix_index()
        if index is not None:
            index.settle()

    def _settle_holds(self) -> None:
        """The holds :meth:`admit` deferred, in order; every method reading the free-queue model or
        the admission state runs this first (the prefix index settles itself on every read)."""
        if self._unheld:
            unheld, self._unheld = self._unheld, []
            for job in unheld:
                self._hold(job)

    def prefix_index(self) -> PrefixIndex | None:
        """The placement policy's prefix index, for the KV-event subscriber (None: the policy
        keeps none, e.g. round-robin)."""
        return self.policy.index if isinstance(self.policy, PrefixAffinityPolicy) else None

    def queue_length(self) -> int:
        return len(self.admission.queue)

    def state_sizes(self) -> dict[str, int]:
        """Entries each part of the state holds now, by name: what a router left running for days
        must keep bounded (``bench.soak``; the ``rollout_router_state_entries`` gauge). Per request,
        back to 0 once nothing is in flight: ``jobs_queued``, ``queued``, ``tickets``,
        ``running_groups``, ``held_blocks``, ``unheld``; bounded by the config: ``keys`` (``max_pins``),
        ``index_blocks`` (``max_index_blocks``), ``touched_stamps``, ``free_stamps``, ``low_points`` and
        ``version_log`` (per replica); one per version loaded: ``history`` and ``cached_versions``
        (the version contract lists them, ``cache_policy.versions``); the rest follow the replicas."""
        self._settle_holds()
        index = self.prefix_index()
        return {"replicas": len(self.replicas), "views": len(self._views), "jobs_queued": len(self._jobs),
                "outbox": len(self._outbox), "unheld": len(self._unheld), **self.registry.sizes(),
                **(index.sizes() if index is not None else {}), **self.admission.sizes(), **self.free_queue.sizes(),
                **self.versions.sizes()}

    def check_integrity(self) -> None:
        """Raise ``RuntimeError('bug: ...')`` if any part of the state is corrupt."""
        self._settle_holds()
        self.admission.check_integrity()
        self.registry.check_integrity()
        self.policy.check_integrity()
        self.free_queue.check_integrity()
        self.versions.check_integrity()
        self._refresh_views()
        for rid in self.replicas:
            if self._views.get(rid) != self._fresh_view(rid):
                raise RuntimeError(f"bug: the view of {rid} is stale: an input changed unmarked")
        for rid, rec in self.replicas.items():
            if not 0 <= rec.answering <= self.admission.ledger.count(rid):
                raise RuntimeError(f"bug: {rec.answering} answering engine requests on {rid}, "
                                   f"{self.admission.ledger.count(rid)} in flight")
        if set(self._views) != set(self.replicas):
            raise RuntimeError(f"bug: views of {sorted(self._views)} != replicas {sorted(self.replicas)}")
        queued = {r.request_id for r in self.admission.queue.waiting()}
        if queued != set(self._jobs):
            raise RuntimeError(f"bug: queued requests {sorted(queued)} != queued jobs {sorted(self._jobs)}")

    # -- internals ------------------------------------------------------------------------------

    def _raw_view(self, rid: ReplicaId) -> ReplicaView:
        return self.replicas[rid].view(self.versions.loaded.get(rid))

    def _view(self, rid: ReplicaId) -> ReplicaView:
        """``rid`` for the policies (see :meth:`_views_of`)."""
        return self._views_of((rid,))[0]

    def _views_of(self, rids: Iterable[ReplicaId]) -> list[ReplicaView]:
        """``rids`` for the policies, with the in-flight count of every router. A view is kept
        until one of its inputs changes (the writers mark the replica: see ``_views``), so the
        candidate scan is one dict lookup per replica (``bench.decision_cost``: at 1,024 replicas
        a stamp of the inputs compared per replica cost ~1 us each)."""
        if self._changed or self._ledger_changed or self._queue_changed:
            self._refresh_views()
        views = self._views
        return [views[rid] for rid in rids]

    def _refresh_views(self) -> None:
        changed = self._changed
        for marked in (self._ledger_changed, self._queue_changed):
            if marked:
                changed |= marked
                marked.clear()
        views, replicas = self._views, self.replicas
        for rid in changed:
            if rid in replicas:
                views[rid] = self._fresh_view(rid)
        changed.clear()

    def _fresh_view(self, rid: ReplicaId) -> ReplicaView:
        """``rid``'s view built from its inputs (the record, the ledger, the queue, its version)."""
        rec, ledger = self.replicas[rid], self.admission.ledger
        load = rec.load
        return ReplicaView(rid, rec.healthy, ledger.count(rid) + ledger.peer(rid).requests, load.kv_cache_usage,
                           load.num_running, load.num_waiting, load.num_gpu_blocks or rec.num_gpu_blocks,
                           rec.block_size, rec.scoring_cap, self.versions.loaded.get(rid),
                           self._queued.get(rid, 0))

    def _candidates(self, job: Job) -> list[ReplicaView]:
        """Every replica ``job`` may use (the candidate scan: one cached view per replica)."""
        skip = self.versions.excluded(job.choice)
        if job.tried:
            skip |= set(job.tried)
        return self._views_of([rid for rid in self.replicas if rid not in skip])

    def _pins_before(self, job: Job) -> dict[str, ReplicaId | None]:
        out = {}
        for kind, key in (("session", job.spec.session_id), ("group", job.spec.group_id)):
            if key is not None:
                rec = self.registry.get(kind, key)
                out[kind] = rec.replica if rec is not None else None
        return out

    def _undo(self, job: Job) -> None:
        """``job`` prefilled nothing: un-index the blocks it added and restore the pins it moved."""
        if job.decision is None:
            return
        rid = job.decision.replica_id
        rec = self.replicas.get(rid)
        if rec is not None and rec.incarnation == job.incarnation:
            self.policy.on_rejected(job.view, job.decision)  # not from a restarted or re-added replica's
        keys = {"session": job.spec.session_id, "group": job.spec.group_id}
        for kind, before in job.undo_pins.items():
            rec = self.registry.get(kind, keys[kind])
            if rec is not None and rec.replica == rid and before != rid:
                if before is None or before not in self.replicas:
                    self.registry.unpin(kind, keys[kind], rid)
                else:
                    self.registry.record(kind, keys[kind], before)

    def _refuse(self, job: Job, reason: str, now: float) -> None:
        job.queued = None
        self.finish(job, "refused", now)
        job.admission = Admission("reject", reason, self.admission.retry_after_s(now))
        self._outbox.append((job, job.admission))

    def _expire(self, now: float) -> None:
        """Queued jobs past ``queue_timeout_s``: admitted late where running work leaves room
        (``AdmissionState.expire``), else refused; both go out with the next ``pump``."""
        if not self._jobs:  # nothing queued
            return
        def view_of(rid: ReplicaId) -> ReplicaView | None:
            rec = self.replicas.get(rid)
            return self._view(rid) if rec is not None and rec.healthy and rid not in self.versions.rotation else None

        late, refused = self.admission.expire(now, view_of)
        for request, adm in late:
            self._admitted_from_queue(request, adm, now)
        for request in refused:
            self._refuse(self._jobs.pop(request.request_id), "timeout", now)

    def _drop_queue(self, rid: ReplicaId) -> None:
        for request in self.admission.queue.drop_replica(rid):
            job = self._jobs.pop(request.request_id)
            job.queued = None
            self._outbox.append((job, self._replica_gone(job, rid)))

    def _replica_gone(self, job: Job, rid: ReplicaId) -> Admission:
        """``job``, placed on ``rid`` and not sent, loses it (it left): unrouted, to be placed
        again elsewhere (``replica_gone``)."""
        job.tried.append(rid)
        return self._unplace(job, rid, f"replica {rid} left rotation")

    def _unplace(self, job: Job, rid: ReplicaId, reason: str) -> Admission:
        """``job``, placed on ``rid`` and neither admitted nor sent, is unrouted (its pins and index
        entries undone): the caller places it again (verdict ``replica_gone``)."""
        self.policy.on_finished(job.view, rid)
        self._undo(job)
        job.decision = None
        job.admission = Admission("replica_gone", reason)
        return job.admission

    def _offer_joined(self, now: float) -> None:
        """Queued work moves to a replica that joined with room (:attr:`_joined`).

        Without this a replica added while requests queue (the moment one is added to relieve
        a queue) got none of them: a queued request stays on the replica it was placed on, and
        only requests placed after the join could go there. A request moves when moving loses
        nothing (``cache_policy.move_rule``'s cost: no prefix cached where it waits, its
        ``matched_blocks`` 0; a GRPO group's queued members move together, see
        :meth:`_move_queued`) and it may run on the replica (version, not tried); in service
        order, while it fits the replica's watermark (``admission.fits``, counting every request moved before it
        at its full peak, the parked guard kept), a new session only while the replica's session
        share has room (``AdmissionState.sessions_full``, sessions moved in the same pass
        counted), and the replica queues nothing of its own. A
        moved job comes back from :meth:`pump` as ``replica_gone`` with :attr:`Job.move_to` set:
        the caller places it again as it places any job (shared pins claimed), and :meth:`place`
        chooses that replica. A replica of unknown size waits for the scrape that gives it.

        The offer stands while work waits elsewhere and none for the replica itself: what did
        not fit at the join moves as its first requests end there (each :meth:`pump`), and it
        ends once the replica queues work of its own or nothing waits (then placement alone
        spreads new work, as ``cache_policy.sent`` does).

        Only a replica that joins (:meth:`add_replica`) is offered work, not one healthy again or
        back in rotation after a weight update: offered too, ``bench.sim --replicas 64 --workloads
        updates --ws-over-kv 2`` read prefilled/ideal 1.076-1.140 vs 1.104-1.181 before on seed 0
        but 1.108-1.172 vs 1.104-1.172 on seed 1, busiest/mean prefill 1.44-1.59 vs 1.25-1.31 there,
        and GRPO group p99 53-60 s vs 31-43 s on both: no gain to keep, and a longer group tail."""
        queue: tuple[list[AdmissionRequest], dict[tuple[str, ReplicaId], list[AdmissionRequest]]] | None = None
        for rid in list(self._joined):
            if not self._in_service(rid) or not self._jobs:
                del self._joined[rid]
                continue
            raw = self._view(rid)
            if raw.num_gpu_blocks <= 0 or raw is self._joined[rid]:
                continue  # its size comes with its first scrape; nothing changed there since the last offer
            if self._queued.get(rid):  # work queues for it too: it is as busy as the rest
                del self._joined[rid]
                continue
            self._joined[rid] = raw
            if queue is None:  # one read of the queue for every joined replica (a job moved since is gone from _jobs)
                waiting = self.admission.queue.waiting()
                groups: dict[tuple[str, ReplicaId], list[AdmissionRequest]] = {}
                for request in waiting:
                    if request.group_id is not None:
                        groups.setdefault((request.group_id, request.replica_id), []).append(request)
                queue = waiting, groups
            if not self._move_queued(rid, raw, now, queue[0], dict(queue[1])):
                del self._joined[rid]  # nothing waiting may ever move there: the offer ends

    def _movable(self, job: Job | None, rid: ReplicaId) -> bool:
        """Whether queued ``job`` may run on ``rid`` (placed, not tried there, its version allowed)."""
        return (job is not None and job.decision is not None and job.decision.replica_id != rid
                and rid not in job.tried and self.versions.allows(rid, job.choice))

    def _move_queued(self, rid: ReplicaId, raw: ReplicaView, now: float, waiting: list[AdmissionRequest],
                     groups: dict[tuple[str, ReplicaId], list[AdmissionRequest]]) -> bool:
        """:meth:`_offer_joined` for one replica: pick the queued units that move, send them back.
        True when the scan stopped at a unit that may move but does not fit yet (the offer
        stands: it may fit once work there ends); False when it went through the queue (what did
        not move never will: not movable there, or a new session over the share, which waits for
        a session to end as it would anywhere).

        A unit is one request, or every queued request of a GRPO group on one replica, moved
        together and counted at the first member's peak plus the others' blocks beyond the
        group's prompt (``AdmissionRequest.joined_holds``), when nothing of the group runs there
        and the first member found nothing cached: the members' matches there are the first's
        prediction, not KV the replica holds (a group moved member by member would split).
        ``waiting``: the queue in service order, ``groups``: its GRPO members by (group, replica),
        both as read once per :meth:`pump` (this consumes ``groups``)."""
        view = project(raw, self.admission.ledger, self.registry)
        guard = self.admission.parked_guard(raw, self.free_queue.freed(rid))
        pending, moving, opening, blocked = 0, [], [], False
        for request in waiting:
            if request.group_id is None:
                job = self._jobs.get(request.request_id)
                if not self._movable(job, rid) or job.decision.matched_blocks:
                    continue
                unit, holds = [request], request.holds
            else:
                unit = groups.pop((request.group_id, request.replica_id), None)
                if unit is None:
                    continue  # its group was judged at its first queued member
                jobs = [self._jobs.get(r.request_id) for r in unit]
                if not all(self._movable(j, rid) for j in jobs):
                    continue
                first = min(jobs, key=lambda j: j.id)
                if first.decision.matched_blocks or self.admission.ledger.group_running(request.group_id,
                                                                                         request.replica_id):
                    continue
                order = sorted(range(len(unit)), key=lambda i: jobs[i].id)  # the first member goes first
                unit = [unit[i] for i in order]
                holds = unit[0].holds + sum(r.holds if r.joined_holds is None else r.joined_holds for r in unit[1:])
            if request.opens_session and self.admission.sessions_full(raw, now, opening):
                continue  # the session share holds there as everywhere (it may start elsewhere)
            if not fits(view, pending, holds, self.cfg, guard)[0]:
                blocked = True
                break
            pending += holds
            moving.extend(unit)
            if request.opens_session:
                opening.append(request.holds)
        self.admission.queue.take(moving)
        for request in moving:
            job = self._jobs.pop(request.request_id)
            job.queued, job.move_to = None, rid
            self._outbox.append((job, self._unplace(job, request.replica_id,
                                                    f"replica {rid} joined with room: moved there")))
        return blocked

    def _sweep(self, now: float) -> None:
        """Expire idle key records, at most once per second of ``now``."""
        if now - self._swept_at >= 1.0:
            self._swept_at = now
            self.registry.expire(now)
            index = self.prefix_index()
            if index is not None:
                index.expire(now)  # predictions no KV event confirmed in time
