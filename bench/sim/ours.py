""""Ours": the project's decision core (``cache_policy.core.DecisionCore``) behind ``SimRouter``.

Only an adapter: every placement, admission, salt and version decision is the core's; this file
translates the simulator's items into ``RequestSpec``s (as ``router/generate.py`` and
``router/score.py`` do) and engine state into ``ReplicaLoad`` scrapes. A scoring fan-out is one
job of ``fan_out = K`` (the router's ``/v1/score``): all K requests go to the placed replica.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from bench.sim.router import Handle, Verdict
from cache_policy.config import PolicyConfig

from cache_policy.core import DecisionCore, ReplicaLoad, RequestSpec

if TYPE_CHECKING:
    from bench.sim.engine import Engine
    from bench.sim.workloads import Item


class Ours:
    """``DecisionCore`` with ``policy`` (default ``prefix_affinity``), admission on, scraped
    every ``FleetConfig.scrape_s`` like the router's metrics loop."""

    wants_scrapes = True
    split_fanout = False

    def __init__(self, weight_policy: str = "keep+salt", *, policy: str = "prefix_affinity",
                 cfg: PolicyConfig | None = None, admission: bool = True, seed: int = 0) -> None:
        self.name = "ours" if policy == "prefix_affinity" else f"ours:{policy}"
        self.weight_policy = weight_policy
        self.core = DecisionCore(cfg or PolicyConfig(), policy=policy, seed=seed,
                                 weight_update_policy=weight_policy, initial_version=0, admission=admission)
        self._handles: dict[int, Handle] = {}
        self.reasons: Counter[str] = Counter()
        """Placements by ``RouteReason`` (session, group, prefix, load, balance, repin)."""

    def add_replica(self, rid: str, block_size: int, num_blocks: int) -> None:
        self.core.add_replica(rid, block_size=block_size, num_gpu_blocks=num_blocks)

    def open(self, item: Item, subs: tuple[int, ...], now: float) -> Handle:
        if item.kind == "score":
            spec = RequestSpec(item.prompt, item.session_id, item.group_id, kind="score",
                               new_tokens=sum(len(item.responses[j]) + 1 for j in subs), fan_out=len(subs))
        else:
            spec = RequestSpec(item.prompt, item.session_id, item.group_id, kind="generate",
                               new_tokens=sum(item.max_tokens[j] for j in subs), fan_out=len(subs),
                               ends_session=item.ends_session)
        job = self.core.open(spec, now)
        return Handle(item, subs, salt=job.salt, job=job)

    def place(self, h: Handle, now: float) -> str | None:
        decision = self.core.place(h.job, now)
        h.replica = decision.replica_id if decision is not None else None
        if decision is not None:
            self.reasons[decision.reason.value] += 1
        return h.replica

    def admit(self, h: Handle, now: float) -> Verdict:
        adm = self.core.admit(h.job, now)
        if adm.verdict == "queue":
            self._handles[h.job.id] = h
        elif adm.verdict == "reject":
            self._reopen(h, adm.retry_after_s, now)
        return adm.verdict

    def _reopen(self, h: Handle, retry_after_s: float | None, now: float) -> None:
        """A refused job is finished in the core; the client retries it as a new request."""
        h.retry_after_s = retry_after_s or 0.05
        fresh = self.open(h.item, h.subs, now)
        h.job, h.salt, h.replica = fresh.job, fresh.salt, None

    def pump(self, now: float) -> list[tuple[Handle, Verdict]]:
        out = []
        for job, adm in self.core.pump(now):
            h = self._handles.pop(job.id)
            if adm.verdict == "admit":
                out.append((h, "admit"))
            elif adm.verdict == "replica_gone":
                out.append((h, "reject"))
            else:
                self._reopen(h, adm.retry_after_s, now)
                out.append((h, "reject"))
        return out

    def finish(self, h: Handle, now: float) -> None:
        self.core.finish(h.job, "ok", now)

    def end_key(self, kind: str, key: str, now: float) -> None:
        if kind == "session":
            self.core.end_session(key)

    def observe(self, rid: str, engine: Engine, now: float) -> None:
        self.core.observe_load(rid, ReplicaLoad(engine.kv_usage, engine.num_running, engine.num_waiting,
                                                engine.cfg.num_blocks, engine.stats.preemptions),
                               scrape_started_at=now)

    def weights_updated(self, version: int, now: float) -> None:
        self.core.finish_update(version, self.weight_policy)
        for rid in self.core.replicas:
            self.core.version_loaded(rid, version)

    def cache_reset(self, rid: str) -> None:
        self.core.cache_reset(rid)
