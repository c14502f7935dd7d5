"""The router side of the simulator: one small protocol, ``SimRouter``, shaped like the
decision core's facade (open -> place -> admit (-> pump) -> finish), so "ours" (``bench.sim.ours``,
the project's ``cache_policy.core.DecisionCore``) and every baseline (``bench.sim.baselines``)
are driven by the same fleet loop.

A baseline is what RL teams run today in front of vLLM: a Rust router that picks a replica and
dispatches at once (no admission queue). The *client* then chooses the cache salt itself, as a
trainer must without our router: ``ClientSalts`` applies the seed's four weight-update policies
from the client side (flush / keep: no salt; salt: the current version's; keep+salt: the version
the session or group started under). Ours gets its salt from the core instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    from bench.sim.engine import Engine
    from bench.sim.workloads import Item

Verdict = Literal["admit", "queue", "reject"]


@dataclass(eq=False)
class Handle:
    """One item's life in a router. ``hashes``: the prompt's full-block hashes under ``salt``
    (the fleet computes them after ``open``; baselines that need a prefix read them)."""

    item: Item
    subs: tuple[int, ...] = (0,)
    prompt_tokens: int = 0
    salt: str | None = None
    replica: str | None = None
    hashes: tuple[int, ...] = ()
    retry_after_s: float = 0.05
    job: object = None
    extra: dict = field(default_factory=dict)

    @property
    def fan_out(self) -> int:
        """Engine requests this handle dispatches (a scoring fan-out routed whole counts K)."""
        return len(self.subs)


class SimRouter(Protocol):
    """What the fleet loop calls. ``place`` returns a replica id or None (none eligible now:
    retry later); ``admit`` says admit / queue (comes back from ``pump``) / reject (retry after
    ``handle.retry_after_s``)."""

    name: str
    split_fanout: bool
    """True: a scoring fan-out's K requests are routed one by one (as a client sends them to a
    router without a scoring endpoint); False: routed once, all K to one replica."""

    def add_replica(self, rid: str, block_size: int, num_blocks: int) -> None: ...
    def open(self, item: Item, subs: tuple[int, ...], now: float) -> Handle: ...
    def place(self, h: Handle, now: float) -> str | None: ...
    def admit(self, h: Handle, now: float) -> Verdict: ...
    def pump(self, now: float) -> list[tuple[Handle, Verdict]]: ...
    def finish(self, h: Handle, now: float) -> None: ...
    def end_key(self, kind: str, key: str, now: float) -> None: ...
    def observe(self, rid: str, engine: Engine, now: float) -> None: ...
    def weights_updated(self, version: int, now: float) -> None: ...
    def cache_reset(self, rid: str) -> None: ...

    @property
    def wants_scrapes(self) -> bool: ...


class ClientSalts:
    """The client-side salt a trainer sends through a router that knows nothing of versions."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self.version = 0
        self.started: dict[str, int] = {}

    def salt(self, item: Item) -> str | None:
        if self.policy in ("flush", "keep"):
            return None
        if self.policy == "salt":
            return f"v{self.version}"
        key = item.session_id or item.group_id
        if key is None:
            return f"v{self.version}"
        return f"v{self.started.setdefault(key, self.version)}"

    def end(self, key: str) -> None:
        self.started.pop(key, None)
