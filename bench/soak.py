"""``python -m bench.soak``: the decision core left running for a simulated week.

A router in front of an RL run stays up for days while the trainer updates the weights every
step, sessions come and go (most never say they ended), replicas restart and the fleet changes.
Whatever the core keeps must stay bounded, and a request must cost on the last day what it cost
on the first. This drives the project's own ``DecisionCore`` (pure, on a simulated clock: no
engines, no HTTP) through ``--steps`` trainer steps of ``--step-s`` seconds each (default 20,160
steps of 30 s: a week), every step:

* agent sessions: each live session takes a turn (its prompt grows by a reply and an
  observation); a session ends after its last turn, by ``X-Session-End`` (half of them) or by
  going idle (the rest); new sessions replace them;
* a GRPO group (``--group-size`` members, one prompt), a scoring fan-out (``--fan-out``
  responses) and a few one-off prompts;
* what the router asks of each request besides (``router.lifecycle``): the versions of the KV
  it may reuse and, with its answer, whether its replica's version moved since dispatch;
* outcomes as the router meets them: most ``ok``, some ``cancelled`` (a client gone, also while
  queued), ``refused`` (a 4xx), ``retry`` (a 5xx: placed again elsewhere);
* a scrape of every replica and a weight update (each replica out of rotation, loaded, back),
  every ``--update-every`` steps;
* every ``--restart-every`` steps one replica restarts (empty cache), and every
  ``--churn-every`` steps one replica leaves and a new one joins.

Prints, per part of the core's state (``DecisionCore.state_sizes``), its size at checkpoints
through the run and after a drain (everything in flight finished, the clock past every idle and
key TTL), the bound it should keep and a verdict (``bounded``; ``drained``: 0 after the drain;
``per version``: at most one entry per version loaded, per replica for ``cached_versions``; failing:
``OVER BOUND``, ``GROWS``, ``LEFT BEHIND``, and the exit status is then 1); and the core's
microseconds per request in the run's last tenth over its second (the first is warm-up: the prefix
index fills). That ratio is timing on whatever else the machine runs: on a shared 2-core VM the
same code read 0.7-1.6 over 1,000-2,000 steps; only a long run (the default week) shows a cost
that grows with the versions. Writes ``soak.json`` (with the run's config and bounds) and
``soak.png`` (sizes over simulated days) under ``--out`` (default ``results/soak``).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from bench.console import wide_console_width
from cache_policy.admission_state import TOUCHED_KEPT
from cache_policy.config import PolicyConfig
from cache_policy.core import DecisionCore, Job, ReplicaLoad, RequestSpec
from cache_policy.versions import LOG_KEPT

PER_REQUEST = ("jobs_queued", "outbox", "unheld", "queued", "tickets", "running_groups", "held_blocks")
"""Parts that hold a request only while it is queued or in flight: 0 after the drain."""
PER_VERSION = ("history", "cached_versions")
"""Parts the version contract keeps one entry per version in (``cache_policy.versions``)."""


@dataclass
class SoakConfig:
    """One soak run (sizes in tokens; times in simulated seconds)."""

    steps: int = 20_160
    step_s: float = 30.0
    replicas: int = 8
    sessions: int = 24
    turns: tuple[int, int] = (2, 12)
    group_size: int = 8
    fan_out: int = 4
    one_offs: int = 2
    update_every: int = 1
    restart_every: int = 500
    churn_every: int = 2_000
    weight_policy: str = "keep+salt"
    block_size: int = 16
    num_gpu_blocks: int = 4_096
    seed: int = 0
    checkpoints: int = 8
    policy: PolicyConfig = field(default_factory=lambda: PolicyConfig(max_pins=20_000, max_index_blocks=100_000))


@dataclass
class _Session:
    sid: str
    prompt: list[int]
    turns_left: int
    says_end: bool


class Soak:
    """The simulated week: :meth:`run` returns the checkpoints, the drained sizes and the cost."""

    def __init__(self, cfg: SoakConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.core = DecisionCore(cfg.policy, seed=cfg.seed, weight_update_policy=cfg.weight_policy,
                                 initial_version=0)
        self.now = 0.0
        self.version = 0
        self.next_replica = 0
        self.next_key = 0
        self.sessions: list[_Session] = []
        self.queued: list[Job] = []
        self.requests = 0
        self.decision_s: list[float] = []
        """Core seconds per request, per step (open, place, admit and finish of each)."""
        for _ in range(cfg.replicas):
            self._join()

    # -- the fleet -------------------------------------------------------------------------------

    def _join(self) -> None:
        rid = f"replica-{self.next_replica}"
        self.next_replica += 1
        self.core.add_replica(rid, block_size=self.cfg.block_size, num_gpu_blocks=self.cfg.num_gpu_blocks,
                              version=self.version)

    def _scrape(self) -> None:
        for rid in list(self.core.replicas):
            running = self.core.in_flight(rid)
            self.core.observe_load(rid, ReplicaLoad(min(0.9, 0.05 * running), running, 0, self.cfg.num_gpu_blocks),
                                   scrape_started_at=self.now)

    def _update(self) -> None:
        self.version += 1
        for rid in list(self.core.replicas):  # as router.weights.steps: out, loaded, (flush: reset), back
            self.core.set_rotation(rid, "updating")
            self.core.version_loaded(rid, self.version)
            if self.cfg.weight_policy == "flush":
                self.core.cache_reset(rid)
            self.core.set_rotation(rid, None)
        self.core.finish_update(self.version, self.cfg.weight_policy)

    # -- requests --------------------------------------------------------------------------------

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(8, 50_000) for _ in range(n)]

    def _key(self, prefix: str) -> str:
        self.next_key += 1
        return f"{prefix}{self.next_key}"

    def _send(self, spec: RequestSpec, at: float) -> None:
        """One request's life in the core, as ``router.lifecycle`` runs it, with an outcome drawn
        as the router meets them; a queued one waits for a later pump."""
        started = time.perf_counter()
        self._run(self.core.open(spec, at), at)
        self.decision_s.append(time.perf_counter() - started)
        self.requests += 1

    def _run(self, job: Job, at: float) -> None:
        """Place, admit and end ``job`` (placed again after a retry or when its replica left)."""
        core = self.core
        for _ in range(3):  # a retry places it again elsewhere
            if core.place(job, at) is None:
                core.finish(job, "failed", at)
                break
            adm = core.admit(job, at)
            if adm.verdict == "queue":
                self.queued.append(job)
                break
            if adm.verdict == "replica_gone":  # it left between place and admit: place it again
                continue
            if adm.verdict != "admit":  # rejected: the core finished it
                break
            core.kv_versions(job)  # what the router asks of each request: its first span's KV
            core.versions_since(job)  # and, with its answer, whether its replica's version moved
            draw = self.rng.random()
            outcome = "cancelled" if draw < 0.02 else "refused" if draw < 0.03 else "retry" if draw < 0.04 else "ok"
            core.settle()
            core.finish(job, outcome, at + 0.5)
            if outcome != "retry":
                break
        else:
            core.finish(job, "failed", at)

    def _pump(self, at: float) -> None:
        for job, adm in self.core.pump(at):
            if job in self.queued:
                self.queued.remove(job)
            if adm.verdict == "admit":
                self.core.finish(job, "ok", at + 0.5)
            elif adm.verdict == "replica_gone":  # its replica left rotation while it waited: place it again
                self._run(job, at)
        keep = []
        for job in self.queued:  # a client gone while its request waited
            if self.rng.random() < 0.05:
                self.core.finish(job, "cancelled", at)
            else:
                keep.append(job)
        self.queued = keep

    def step(self) -> None:
        cfg, at = self.cfg, self.now
        while len(self.sessions) < cfg.sessions:
            self.sessions.append(_Session(self._key("s"), self._tokens(self.rng.randrange(256, 1024)),
                                          self.rng.randrange(*cfg.turns), self.rng.random() < 0.5))
        for s in list(self.sessions):
            s.turns_left -= 1
            ends = s.turns_left <= 0
            self._send(RequestSpec(s.prompt, session_id=s.sid, new_tokens=128, ends_session=ends and s.says_end), at)
            s.prompt = s.prompt + self._tokens(self.rng.randrange(64, 256))
            if ends:
                self.sessions.remove(s)  # says so, or goes idle: the core ends it after session_idle_s
        group, prompt = self._key("g"), self._tokens(self.rng.randrange(512, 2048))
        for _ in range(cfg.group_size):
            self._send(RequestSpec(prompt, group_id=group, new_tokens=256), at)
        context = self._tokens(self.rng.randrange(512, 2048))
        self._send(RequestSpec(context, kind="score", new_tokens=cfg.fan_out * 64, fan_out=cfg.fan_out), at)
        for _ in range(cfg.one_offs):
            self._send(RequestSpec(self._tokens(self.rng.randrange(64, 1024)), new_tokens=64), at)
        self._pump(at + 1.0)
        self._scrape()

    def run(self, progress=None) -> dict:
        """The whole soak: returns ``checkpoints`` (step, simulated s, sizes), ``drained`` (sizes
        after every request ended and the clock passed every TTL), and the per-request cost."""
        cfg = self.cfg
        marks = {round(cfg.steps * k / cfg.checkpoints) for k in range(1, cfg.checkpoints + 1)}
        checkpoints = []
        for n in range(1, cfg.steps + 1):
            self.now = n * cfg.step_s
            self.step()
            if cfg.update_every and n % cfg.update_every == 0:
                self._update()
            if cfg.restart_every and n % cfg.restart_every == 0:
                rid = self.rng.choice(sorted(self.core.replicas))
                # from the model (the initial version), then caught up to the current one, as the
                # router's WeightUpdater.catch_up does: a load, then nothing but its KV in the cache
                self.core.restarted(rid, num_gpu_blocks=cfg.num_gpu_blocks)
                self.core.version_loaded(rid, self.version)
                self.core.cache_reset(rid)
            if cfg.churn_every and n % cfg.churn_every == 0:
                self.core.remove_replica(self.rng.choice(sorted(self.core.replicas)), self.now)
                self._join()
            if n in marks:
                self.core.check_integrity()
                checkpoints.append({"step": n, "sim_s": self.now, "versions": self.version + 1,
                                    "sizes": self.core.state_sizes()})
            if progress is not None:
                progress(1)
        for job in self.queued:
            self.core.finish(job, "cancelled", self.now)
        self.queued = []
        p = cfg.policy
        self.now += max(p.session_idle_s, p.key_ttl_s, p.queue_timeout_s, p.predicted_ttl_s) + 10 * cfg.step_s
        self._pump(self.now)
        self.core.pump(self.now)  # the router's scrape round: idle keys and sessions expire
        self.core.check_integrity()
        tenth = max(1, len(self.decision_s) // 10)
        second, last = self.decision_s[tenth:2 * tenth], self.decision_s[-tenth:]  # after a tenth's warm-up
        return {"checkpoints": checkpoints, "drained": self.core.state_sizes(), "requests": self.requests,
                "us_per_request_second_tenth": 1e6 * sum(second) / len(second),
                "us_per_request_last_tenth": 1e6 * sum(last) / len(last)}


def bounds(cfg: SoakConfig) -> dict[str, tuple[int | None, str]]:
    """Per part of the state: the bound it must keep (None: it follows the versions or the fleet)
    and where that bound comes from."""
    p, n = cfg.policy, cfg.replicas
    return {
        "keys": (p.max_pins, "policy.max_pins"),
        "index_blocks": (p.max_index_blocks, "policy.max_index_blocks"),
        "touched_stamps": (TOUCHED_KEPT * n, "TOUCHED_KEPT per replica"),
        "free_stamps": (2 * (2 * cfg.num_gpu_blocks + 1) * n, "two generations of 2x a replica's blocks"),
        "low_points": ((2 * cfg.num_gpu_blocks + 1) * n, "one capacity window of distinct bounds per replica"),
        "version_log": (2 * LOG_KEPT * n, "2 * LOG_KEPT per replica"),
        "replicas": (n, "--replicas"), "views": (n, "--replicas"),
        **{name: (None, "0 once nothing is in flight") for name in PER_REQUEST},
        "history": (None, "one per version loaded (the contract)"),
        "cached_versions": (None, "one per version per replica (the contract)"),
    }


NO_BOUND = "no growth over the run's second half"
"""What a part without a configured bound must keep (``verdicts``: its peak at most 1.5x its size
at the middle checkpoint, plus 16)."""


def verdicts(result: dict, cfg: SoakConfig) -> dict[str, str]:
    """Per part: ``bounded``, ``drained`` (0 after the drain), ``per version`` (as many as the
    versions it must list), or ``GROWS`` / ``OVER BOUND`` / ``LEFT BEHIND``."""
    out, limits = {}, bounds(cfg)
    sizes = [c["sizes"] for c in result["checkpoints"]]
    drained = result["drained"]
    versions = max(s.get("history", 0) for s in sizes)  # when the checkpoints do not say
    for name in drained:
        bound = limits.get(name, (None, ""))[0]
        peak = max(s.get(name, 0) for s in sizes)
        if name in PER_REQUEST:
            out[name] = "drained" if drained[name] == 0 else "LEFT BEHIND"
        elif name in PER_VERSION:  # at each checkpoint, at most one per version loaded by then (per replica)
            per = 1 if name == "history" else cfg.replicas
            fits = all(c["sizes"].get(name, 0) <= per * c.get("versions", versions) for c in result["checkpoints"])
            out[name] = "per version" if fits else "GROWS"
        elif bound is not None:
            out[name] = "bounded" if peak <= bound else "OVER BOUND"
        else:  # no configured bound: it must not keep growing over the second half
            half = sizes[len(sizes) // 2].get(name, 0)
            out[name] = "bounded" if peak <= 1.5 * half + 16 else "GROWS"
    return out


def render(result: dict, cfg: SoakConfig, console: Console) -> None:
    """The table and the cost ratio."""
    days = cfg.steps * cfg.step_s / 86_400
    updates = f"an update every {cfg.update_every} step(s)" if cfg.update_every else "no weight updates"
    table = Table(title=f"bench.soak: DecisionCore over {cfg.steps:,} steps of {cfg.step_s:g} s ({days:.1f} days), "
                        f"{result['requests']:,} requests, {cfg.replicas} replicas, {updates}, {cfg.weight_policy}")
    table.add_column("state", justify="left")
    long_run = result["checkpoints"][-1]["sim_s"] >= 2 * 86_400
    for c in result["checkpoints"]:
        table.add_column(f"day {c['sim_s'] / 86_400:.1f}" if long_run else f"hour {c['sim_s'] / 3_600:.1f}",
                         justify="right")
    for col in ("drained", "bound", "verdict"):
        table.add_column(col, justify="right")
    limits, verdict = bounds(cfg), verdicts(result, cfg)
    for name, after in result["drained"].items():
        bound, why = limits.get(name, (None, NO_BOUND))
        table.add_row(name, *[f"{c['sizes'].get(name, 0):,}" for c in result["checkpoints"]], f"{after:,}",
                      f"{bound:,} ({why})" if bound is not None else why, verdict[name])
    console.print(table)
    second, last = result["us_per_request_second_tenth"], result["us_per_request_last_tenth"]
    console.print(f"core µs per request: {second:.1f} in the run's second tenth, {last:.1f} in its last tenth "
                  f"(last / second = {last / second:.2f}; timing on a shared machine: see --help)")


def plot(result: dict, out: Path) -> Path:
    """Sizes over simulated days (log scale), one line per part that holds anything."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    days = [c["sim_s"] / 86_400 for c in result["checkpoints"]]
    fig, ax = plt.subplots(figsize=(9, 5))
    for name in result["drained"]:
        ys = [c["sizes"].get(name, 0) for c in result["checkpoints"]]
        if max(ys) > 0:
            ax.plot(days, ys, marker="o", label=name)
    ax.set_yscale("symlog")
    ax.set_xlabel("simulated days")
    ax.set_ylabel("entries")
    ax.set_title("DecisionCore state over a soak (bench.soak)")
    ax.legend(fontsize=7, ncol=2)
    path = out / "soak.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> dict:
    d = SoakConfig()
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=d.steps, help=f"trainer steps (default {d.steps:,}: a week of 30 s steps)")
    p.add_argument("--step-s", type=float, default=d.step_s, help="simulated seconds per step")
    p.add_argument("--replicas", type=int, default=d.replicas, help=f"replicas in the fleet (default {d.replicas})")
    p.add_argument("--sessions", type=int, default=d.sessions, help="agent sessions live at once")
    p.add_argument("--group-size", type=int, default=d.group_size, help=f"GRPO group members per step (default {d.group_size})")
    p.add_argument("--fan-out", type=int, default=d.fan_out, help=f"responses of the scoring fan-out per step (default {d.fan_out})")
    p.add_argument("--update-every", type=int, default=d.update_every, help="steps between weight updates (0: none)")
    p.add_argument("--restart-every", type=int, default=d.restart_every, help="steps between replica restarts (0: none)")
    p.add_argument("--churn-every", type=int, default=d.churn_every,
                   help="steps between a replica leaving and a new one joining (0: none)")
    p.add_argument("--weight-policy", choices=["flush", "keep", "salt", "keep+salt"], default=d.weight_policy)
    p.add_argument("--checkpoints", type=int, default=d.checkpoints,
                   help=f"table columns through the run (default {d.checkpoints}; at most --steps)")
    p.add_argument("--seed", type=int, default=d.seed, help="the workload's random seed")
    p.add_argument("--out", type=Path, default=Path("results/soak"), help="folder for soak.json and soak.png")
    a = p.parse_args(argv)
    if a.steps < a.checkpoints or a.checkpoints < 2 or a.replicas < 2:
        p.error("--steps must be >= --checkpoints >= 2 and --replicas >= 2")
    if a.sessions < 0 or a.group_size < 0 or a.fan_out < 1 or not a.step_s > 0:
        p.error("--sessions and --group-size must be >= 0, --fan-out >= 1 and --step-s > 0")
    if min(a.update_every, a.restart_every, a.churn_every) < 0:
        p.error("--update-every, --restart-every and --churn-every must be >= 0 (0: never)")
    cfg = SoakConfig(steps=a.steps, step_s=a.step_s, replicas=a.replicas, sessions=a.sessions,
                     group_size=a.group_size, fan_out=a.fan_out, update_every=a.update_every,
                     restart_every=a.restart_every, churn_every=a.churn_every, weight_policy=a.weight_policy,
                     checkpoints=a.checkpoints, seed=a.seed)
    console = Console(width=wide_console_width(240))
    cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*cols, console=console) as progress:
        task = progress.add_task("soak", total=cfg.steps)
        result = Soak(cfg).run(lambda n: progress.advance(task, n))
    render(result, cfg, console)
    a.out.mkdir(parents=True, exist_ok=True)
    result["verdicts"] = verdicts(result, cfg)
    result["config"] = {k: v for k, v in vars(a).items() if k != "out"}
    result["bounds"] = {name: {"bound": b, "from": why} for name, (b, why) in bounds(cfg).items()}
    (a.out / "soak.json").write_text(json.dumps(result, indent=1))
    console.print(f"wrote {a.out / 'soak.json'} and {plot(result, a.out)}")
    failing = sorted(name for name, v in result["verdicts"].items() if v not in PASSING)
    if failing:
        console.print(f"[bold red]failing: {', '.join(failing)}[/]")
    return result


PASSING = frozenset({"bounded", "drained", "per version"})


if __name__ == "__main__":
    raise SystemExit(1 if set(main()["verdicts"].values()) - PASSING else 0)
