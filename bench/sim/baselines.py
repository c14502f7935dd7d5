"""Baseline routers, each a small policy behind ``SimRouter`` (behaviour as the Rust routers
documented it; re-implemented here from their descriptions, no code copied).

* ``round_robin``: next replica in turn (both routers' ``round_robin``).
* ``least_loaded``: fewest requests in flight at the router, ties to the lowest index
  (verl's least-loaded balancer; SGLang's shortest-queue fallback).
* ``consistent_hash``: a hash ring with 160 virtual nodes per replica keyed by the routing key
  (``X-Session-Id``, else the group id, else the request): vllm-router ``consistent_hash``
  (``VIRTUAL_NODES_PER_WORKER = 160``), SGLang ``consistent_hashing``. The ring hash here is
  xxh3_64, not FurcHash; only the spread's statistics matter.
* ``sticky_least_loaded``: vllm-router ``sticky_least_loaded``: a new routing key goes to the
  replica with the fewest *active keys* (ties: rendezvous hash of key and replica), later
  requests follow it; ``finish_session`` (here: a session's last turn, a group's last sample)
  releases it; requests without a key go to the fewest active keys, unrecorded.
* ``cache_aware``: ``bench.sim.cache_aware`` (SGLang's approximate tree with its thresholds).
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

import xxhash

from bench.sim.router import ClientSalts, Handle, Verdict

if TYPE_CHECKING:
    from bench.sim.engine import Engine
    from bench.sim.workloads import Item


class Baseline:
    """Shared plumbing: replica list, in-flight counts, client-side salts; no queue."""

    name = "baseline"
    wants_scrapes = False
    split_fanout = True

    def __init__(self, weight_policy: str = "keep+salt") -> None:
        self.rids: list[str] = []
        self.index: dict[str, int] = {}
        self.load: list[int] = []
        self.salts = ClientSalts(weight_policy)

    def add_replica(self, rid: str, block_size: int, num_blocks: int) -> None:
        self.index[rid] = len(self.rids)
        self.rids.append(rid)
        self.load.append(0)

    def open(self, item: Item, subs: tuple[int, ...], now: float) -> Handle:
        return Handle(item, subs, salt=self.salts.salt(item))

    def place(self, h: Handle, now: float) -> str | None:
        i = self.choose(h, now)
        h.replica = self.rids[i]
        self.load[i] += h.fan_out
        return h.replica

    def choose(self, h: Handle, now: float) -> int:
        raise NotImplementedError

    def admit(self, h: Handle, now: float) -> Verdict:
        return "admit"

    def pump(self, now: float) -> list[tuple[Handle, Verdict]]:
        return []

    def finish(self, h: Handle, now: float) -> None:
        self.load[self.index[h.replica]] -= h.fan_out

    def end_key(self, kind: str, key: str, now: float) -> None:
        self.salts.end(key)

    def observe(self, rid: str, engine: Engine, now: float) -> None:
        pass

    def weights_updated(self, version: int, now: float) -> None:
        self.salts.version = version

    def cache_reset(self, rid: str) -> None:
        pass

    def _least_loaded(self) -> int:
        load = self.load
        return min(range(len(load)), key=load.__getitem__)


class RoundRobin(Baseline):
    name = "round_robin"

    def __init__(self, weight_policy: str = "keep+salt") -> None:
        super().__init__(weight_policy)
        self.next = 0

    def choose(self, h: Handle, now: float) -> int:
        i = self.next % len(self.rids)
        self.next += 1
        return i


class LeastLoaded(Baseline):
    name = "least_loaded"

    def choose(self, h: Handle, now: float) -> int:
        return self._least_loaded()


def _h64(s: str) -> int:
    return xxhash.xxh3_64_intdigest(s.encode())


class ConsistentHash(Baseline):
    name = "consistent_hash"
    virtual_nodes = 160

    def __init__(self, weight_policy: str = "keep+salt") -> None:
        super().__init__(weight_policy)
        self.ring: list[tuple[int, int]] = []
        self.points: list[int] = []

    def add_replica(self, rid: str, block_size: int, num_blocks: int) -> None:
        super().add_replica(rid, block_size, num_blocks)
        i = self.index[rid]
        self.ring.extend((_h64(f"{rid}:{v}"), i) for v in range(self.virtual_nodes))
        self.ring.sort()
        self.points = [p for p, _ in self.ring]

    def choose(self, h: Handle, now: float) -> int:
        j = bisect.bisect_left(self.points, _h64(h.item.routing_key))
        return self.ring[j % len(self.ring)][1]


class StickyLeastLoaded(Baseline):
    name = "sticky_least_loaded"

    def __init__(self, weight_policy: str = "keep+salt") -> None:
        super().__init__(weight_policy)
        self.sessions: dict[str, int] = {}
        self.active: list[int] = []

    def add_replica(self, rid: str, block_size: int, num_blocks: int) -> None:
        super().add_replica(rid, block_size, num_blocks)
        self.active.append(0)

    def _key(self, item: Item) -> str | None:
        return item.session_id or item.group_id

    def choose(self, h: Handle, now: float) -> int:
        key = self._key(h.item)
        if key is not None and key in self.sessions:
            return self.sessions[key]
        low = min(self.active)
        tie = key or str(h.item.item_id)
        best = max((i for i, a in enumerate(self.active) if a == low),
                   key=lambda i: _h64(f"{tie}:{self.rids[i]}"))
        if key is not None:
            self.sessions[key] = best
            self.active[best] += 1
        return best

    def end_key(self, kind: str, key: str, now: float) -> None:
        super().end_key(kind, key, now)
        i = self.sessions.pop(key, None)
        if i is not None:
            self.active[i] -= 1
