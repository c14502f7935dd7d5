"""Closed-loop RL clients for the fleet simulator (seeded; token IDs from numpy).

* GRPO: ``groups`` groups in flight, each one prompt of ``grpo_prompt`` tokens (uniform range)
  sampled ``group_size`` times at once; a finished group is replaced by a new one.
* Agents: ``sessions`` sessions in flight, ``turns`` turns each; turn k+1's prompt is turn k's
  prompt + its reply + an observation, after a tool-call pause (exponential, mean
  ``tool_pause_s``). The last turn ends the session.
* OPD scoring: ``contexts`` fan-outs in flight, each a context of ``score_context`` tokens and
  ``fan_out`` responses scored against it (prompt = context + response, one output token,
  S = P - 1: the engine's hit is capped at ``min(P - 1, N - 1)`` rounded down to a block).

Every client issues ``Item``s to a ``Sink`` (the fleet) and is called back when one is done.
Weight versions are counted in trainer steps: a step is ``groups_per_step`` finished GRPO groups
(or, without GRPO, the same number of finished sessions), and the fleet's update hook runs every
``update_every`` steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np

Kind = Literal["generate", "score"]
VOCAB = 32000


@dataclass(frozen=True)
class WorkloadConfig:
    """Sizes of the three RL traffic shapes; in-flight counts are per replica (scaled by N).

    The in-flight counts make a live working set of about 55k prompt tokens per replica (3.5k
    blocks of 16), 2.4x the KV floor ``bench.sim.runs`` gives a replica (two of the largest
    requests, 1.4k blocks): so caches at half the working set (``ws_over_kv = 2``) are sized by
    the ratio, not by the floor. (With 2 sessions per replica the floor won, and
    ``--ws-over-kv 2`` ran at 0.53.) A GPU replica holds far more: an 8B model on an H100 keeps
    ~400k tokens of KV, i.e. dozens of such sessions at once.
    """

    groups_per_replica: float = 2.0
    group_size: int = 16
    grpo_prompt: tuple[int, int] = (2000, 8000)
    grpo_output: tuple[int, int] = (64, 256)
    sessions_per_replica: float = 8.0
    turns: int = 8
    first_prompt: tuple[int, int] = (1000, 3000)
    observation: tuple[int, int] = (200, 800)
    reply: tuple[int, int] = (64, 256)
    tool_pause_s: float = 2.0
    contexts_per_replica: float = 1.0
    fan_out: int = 8
    score_context: tuple[int, int] = (2000, 6000)
    score_response: tuple[int, int] = (200, 1000)
    groups_per_step: int = 0
    """GRPO groups per trainer step (0: the number of groups in flight)."""

    def mean(self, r: tuple[int, int]) -> float:
        return (r[0] + r[1]) / 2

    def working_set_tokens(self, n: int, kinds: set[str]) -> float:
        """Expected live prefix tokens across the fleet (what caches must hold for full reuse)."""
        total = 0.0
        if "grpo" in kinds:
            total += self.groups_per_replica * n * self.mean(self.grpo_prompt)
        if "agent" in kinds:
            per_turn = self.mean(self.reply) + self.mean(self.observation)
            total += self.sessions_per_replica * n * (self.mean(self.first_prompt) + per_turn * (self.turns - 1) / 2)
        if "opd" in kinds:
            total += self.contexts_per_replica * n * self.mean(self.score_context)
        return total


@dataclass(eq=False)
class Item:
    """One client request (a scoring fan-out is one item with ``fan_out`` engine requests)."""

    item_id: int
    workload: str
    kind: Kind
    prompt: list[int]
    hash_key: str
    max_tokens: list[int]
    outputs: list[list[int] | None]
    session_id: str | None = None
    group_id: str | None = None
    score_start: int | None = None
    responses: list[list[int]] = field(default_factory=list)
    ends_session: bool = False
    on_done: Callable[[Item, float], None] | None = None
    created_s: float = 0.0
    done_s: float = 0.0

    @property
    def fan_out(self) -> int:
        return max(1, len(self.responses))

    @property
    def routing_key(self) -> str:
        """What a baseline router hashes or pins on (the header RL stacks send)."""
        return self.session_id or self.group_id or f"item-{self.item_id}"


class Sink(Protocol):
    def issue(self, item: Item, now: float) -> None: ...
    def after(self, delay_s: float, fn: Callable[[float], None]) -> None: ...
    def end_session(self, session_id: str, now: float) -> None: ...


class Clients:
    """All clients of one run; ``start(now)`` fills every slot.

    The same work for every router: ``budget`` engine requests are split evenly over the kinds
    (each kind stops at its share, so a router that serves one kind faster cannot change the
    mix), and each GRPO group, session and scoring fan-out draws its tokens, lengths and
    pauses from its own seeded stream (``(seed, kind, index)``), so its content does not
    depend on the order the router finished the others in. (One shared budget and stream made
    the mix the router's: with admission, agent turns were 19% of the prompt tokens, without
    it 6%, and prefilled/ideal compared different work.)"""

    def __init__(self, cfg: WorkloadConfig, kinds: set[str], replicas: int, budget: int, seed: int,
                 sink: Sink, on_step: Callable[[float], None] | None = None) -> None:
        self.cfg, self.kinds, self.sink = cfg, kinds, sink
        self.seed = seed
        self.budget = budget
        self.issued = 0
        self.left = {k: budget // len(kinds) + (1 if i < budget % len(kinds) else 0)
                     for i, k in enumerate(sorted(kinds))}
        """Engine requests each kind may still issue."""
        self._ids = 0
        self._made = dict.fromkeys(("grpo", "agent", "opd"), 0)
        self.on_step = on_step
        self.group_times: list[float] = []
        self.turn_times: list[float] = []
        self.slots = {k: max(1, round(getattr(cfg, f"{p}_per_replica") * replicas)) if k in kinds else 0
                      for k, p in (("grpo", "groups"), ("agent", "sessions"), ("opd", "contexts"))}
        self._groups_done = 0
        self.per_step = cfg.groups_per_step or max(1, self.slots["grpo"] or self.slots["agent"])

    # -- helpers -------------------------------------------------------------------------------
    def _stream(self, kind: str) -> np.random.Generator:
        """The next ``kind`` item's own random stream."""
        self._made[kind] += 1
        return np.random.default_rng((self.seed, ("grpo", "agent", "opd").index(kind), self._made[kind]))

    @staticmethod
    def _n(rng: np.random.Generator, r: tuple[int, int]) -> int:
        return int(rng.integers(r[0], r[1] + 1))

    @staticmethod
    def _tokens(rng: np.random.Generator, n: int) -> list[int]:
        return rng.integers(8, VOCAB, n).tolist()

    def _next_id(self) -> int:
        self._ids += 1
        return self._ids

    def _can_issue(self, kind: str, n: int) -> bool:
        if self.left[kind] < n:
            return False
        self.left[kind] -= n
        self.issued += n
        return True

    def start(self, now: float) -> None:
        for _ in range(self.slots["grpo"]):
            self.new_group(now)
        for _ in range(self.slots["agent"]):
            self.new_session(now)
        for _ in range(self.slots["opd"]):
            self.new_fanout(now)

    def _step_done(self, now: float) -> None:
        self._groups_done += 1
        if self.on_step is not None and self._groups_done % self.per_step == 0:
            self.on_step(now)

    # -- GRPO ----------------------------------------------------------------------------------
    def new_group(self, now: float) -> None:
        g = self.cfg.group_size
        if not self._can_issue("grpo", g):
            return
        rng = self._stream("grpo")
        gid = f"g{self._next_id()}"
        prompt = self._tokens(rng, self._n(rng, self.cfg.grpo_prompt))
        state = {"left": g, "start": now}

        def done(item: Item, t: float) -> None:
            state["left"] -= 1
            if state["left"] == 0:
                self.group_times.append(t - state["start"])
                if "agent" not in self.kinds or self.slots["grpo"]:
                    self._step_done(t)
                self.new_group(t)

        for _ in range(g):
            item = Item(self._next_id(), "grpo", "generate", prompt, gid, [self._n(rng, self.cfg.grpo_output)], [None],
                        group_id=gid, on_done=done)
            self.sink.issue(item, now)

    # -- agents --------------------------------------------------------------------------------
    def new_session(self, now: float) -> None:
        if not self._can_issue("agent", 1):
            return
        rng = self._stream("agent")
        sid = f"s{self._next_id()}"
        self._turn(sid, rng, self._tokens(rng, self._n(rng, self.cfg.first_prompt)), 0, now)

    def _turn(self, sid: str, rng: np.random.Generator, context: list[int], k: int, now: float) -> None:
        last = k == self.cfg.turns - 1
        reply = self._tokens(rng, self._n(rng, self.cfg.reply))

        def done(item: Item, t: float) -> None:
            self.turn_times.append(t - item.created_s)
            if last:
                if "grpo" not in self.kinds:
                    self._step_done(t)
                self.sink.end_session(sid, t)
                self.new_session(t)
                return
            grown = context + reply + self._tokens(rng, self._n(rng, self.cfg.observation))
            pause = float(rng.exponential(self.cfg.tool_pause_s))

            def next_turn(t2: float) -> None:
                if self._can_issue("agent", 1):
                    self._turn(sid, rng, grown, k + 1, t2)
                else:
                    self.sink.end_session(sid, t2)
            self.sink.after(pause, next_turn)

        item = Item(self._next_id(), "agent", "generate", context, sid, [len(reply)], [reply],
                    session_id=sid, ends_session=last, on_done=done)
        self.sink.issue(item, now)

    # -- OPD scoring ---------------------------------------------------------------------------
    def new_fanout(self, now: float) -> None:
        k = self.cfg.fan_out
        if not self._can_issue("opd", k):
            return
        rng = self._stream("opd")
        context = self._tokens(rng, self._n(rng, self.cfg.score_context))
        responses = [self._tokens(rng, self._n(rng, self.cfg.score_response)) for _ in range(k)]
        cid = f"c{self._next_id()}"
        item = Item(self._next_id(), "opd", "score", context, cid, [1] * k, [None] * k, session_id=None,
                    score_start=len(context) - 1, responses=responses,
                    on_done=lambda it, t: self.new_fanout(t))
        self.sink.issue(item, now)
