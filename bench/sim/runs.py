"""Named workloads, router factories, KV sizing: one ``Run`` per (scale, workload, policy).

Workloads: ``grpo``, ``agent``, ``opd`` (one shape each), ``updates`` (GRPO + agents with a
weight update every ``update_every`` trainer steps, once per version policy: flush, keep, salt,
keep+salt) and ``mixed`` (all three shapes, updates under ``--weight-policy``).

KV sizing: each replica gets ``working set / (ws_over_kv * N)`` tokens of blocks, where the
working set is the expected live prefix tokens of the workload (``WorkloadConfig
.working_set_tokens``); ``ws_over_kv = 2`` means the caches hold half the working set. A replica
never gets fewer blocks than two of the largest requests need.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from bench.sim.baselines import ConsistentHash, LeastLoaded, RoundRobin, StickyLeastLoaded
from bench.sim.cache_aware import CacheAware
from bench.sim.engine import EngineConfig
from bench.sim.fleet import Fleet, FleetConfig
from bench.sim.workloads import WorkloadConfig

KINDS = {"grpo": {"grpo"}, "agent": {"agent"}, "opd": {"opd"}, "updates": {"grpo", "agent"},
         "mixed": {"grpo", "agent", "opd"}}
WEIGHT_POLICIES = ("flush", "keep", "salt", "keep+salt")


def _ours(weight_policy: str, admission: bool = True):
    from bench.sim.ours import Ours  # the core is imported only when ours runs
    router = Ours(weight_policy, admission=admission)
    if not admission:
        router.name = "ours_no_admission"
    return router


ROUTERS: dict[str, Callable[[str], object]] = {
    "ours": _ours, "round_robin": RoundRobin, "least_loaded": LeastLoaded,
    "consistent_hash": ConsistentHash, "sticky_least_loaded": StickyLeastLoaded, "cache_aware": CacheAware,
    "ours_no_admission": lambda weight_policy: _ours(weight_policy, admission=False),
}
DEFAULT_POLICIES = [p for p in ROUTERS if p != "ours_no_admission"]
"""Run by default; ``ours_no_admission`` (the same core, every request admitted at once:
placement alone, as the baselines dispatch) is asked for with ``--policies``."""


@dataclass(frozen=True)
class Run:
    """One simulated run and its label."""

    workload: str
    policy: str
    cfg: FleetConfig
    ws_over_kv: float

    @property
    def label(self) -> str:
        wp = f"/{self.cfg.weight_policy}" if self.cfg.update_every else ""
        return f"N={self.cfg.replicas} {self.workload}{wp} ws/kv={self.ws_over_kv:g} {self.policy}"


def blocks_per_replica(w: WorkloadConfig, kinds: set[str], n: int, ws_over_kv: float, block_size: int) -> int:
    """KV blocks per replica so the fleet holds ``1 / ws_over_kv`` of the working set."""
    ws = w.working_set_tokens(n, kinds)
    largest = max(w.grpo_prompt[1] + w.grpo_output[1], w.first_prompt[1] + w.turns * (w.reply[1] + w.observation[1]),
                  w.score_context[1] + w.score_response[1])
    floor = 2 * (largest // block_size + 1)
    return max(floor, int(ws / ws_over_kv / n / block_size))


def make_runs(scales: list[int], workloads: list[str], policies: list[str], ws_ratios: list[float],
              base: FleetConfig, update_every: int, weight_policy: str) -> list[Run]:
    """The cross product, with ``updates`` expanded over the four version policies."""
    runs = []
    for n in scales:
        for wl in workloads:
            kinds = KINDS[wl]
            wps = WEIGHT_POLICIES if wl == "updates" else (weight_policy,)
            every = update_every if wl in ("updates", "mixed") else 0
            for ratio in ws_ratios:
                blocks = blocks_per_replica(base.workload, kinds, n, ratio, base.engine.block_size)
                for wp in wps:
                    for p in policies:
                        cfg = replace(base, replicas=n, kinds=frozenset(kinds), update_every=every, weight_policy=wp,
                                      engine=replace(base.engine, num_blocks=blocks))
                        runs.append(Run(wl, p, cfg, ratio))
    return runs


def _actual_ratio(cfg: FleetConfig) -> float:
    """Working set / fleet KV capacity as sized (above the request if the per-replica floor won)."""
    ws = cfg.workload.working_set_tokens(cfg.replicas, set(cfg.kinds))
    return ws / (cfg.engine.num_blocks * cfg.replicas * cfg.engine.block_size)


def execute(run: Run, progress: Callable[[int], None] | None = None) -> tuple[dict, Fleet]:
    """Run it; return the summary row (with the run's identity) and the finished fleet."""
    router = ROUTERS[run.policy](run.cfg.weight_policy)
    fleet = Fleet(run.cfg, router, progress)
    rec = fleet.run()
    row = {"scale": run.cfg.replicas, "workload": run.workload, "policy": run.policy,
           "weight_policy": run.cfg.weight_policy if run.cfg.update_every else None,
           "ws_over_kv": run.ws_over_kv, "blocks_per_replica": run.cfg.engine.num_blocks,
           "ws_over_kv_actual": _actual_ratio(run.cfg),
           "updates": len(rec.updates), **rec.summary(fleet.clients.group_times)}
    return row, fleet


def engine_config(block_size: int, max_num_seqs: int, token_budget: int) -> EngineConfig:
    return EngineConfig(block_size=block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=token_budget)
