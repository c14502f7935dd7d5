"""bench.sim's routers and fleet loop (pure, seconds)."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from bench.sim.baselines import ConsistentHash, RoundRobin, StickyLeastLoaded
from bench.sim.cache_aware import CacheAware
from bench.sim.engine import EngineConfig
from bench.sim.fleet import Fleet, FleetConfig
from bench.sim.ours import Ours
from bench.sim.router import Handle
from bench.sim.workloads import Item, WorkloadConfig

SMALL = FleetConfig(replicas=4, engine=EngineConfig(num_blocks=1500), requests=600,
                    workload=WorkloadConfig(grpo_prompt=(1000, 2000), first_prompt=(500, 1000), turns=4,
                                            score_context=(800, 1600), score_response=(100, 200)))


def item(i: int, session: str | None = None, group: str | None = None) -> Item:
    return Item(i, "agent", "generate", [1] * 40, f"k{i}", [4], [None], session_id=session, group_id=group)


def routers(cls, n: int = 4):
    r = cls()
    for i in range(n):
        r.add_replica(f"r{i}", 16, 100)
    return r


def place(r, it: Item, hashes: tuple[int, ...] = ()) -> str:
    h = r.open(it, (0,), 0.0)
    h.hashes, h.prompt_tokens = hashes, 64
    return r.place(h, 0.0)


def test_round_robin_cycles():
    r = routers(RoundRobin)
    assert [place(r, item(i)) for i in range(6)] == ["r0", "r1", "r2", "r3", "r0", "r1"]


def test_consistent_hash_keeps_a_key_and_spreads_keys():
    r = routers(ConsistentHash)
    assert len({place(r, item(i, session="s-7")) for i in range(5)}) == 1
    spread = Counter(place(r, item(i, session=f"s{i}")) for i in range(2000))
    assert set(spread) == {"r0", "r1", "r2", "r3"}
    assert max(spread.values()) < 2000 * 0.4  # 160 virtual nodes each: no replica near half


def test_sticky_least_loaded_puts_new_keys_on_the_fewest_active_and_releases_at_the_end():
    r = routers(StickyLeastLoaded)
    first = [place(r, item(i, session=f"s{i}")) for i in range(4)]
    assert sorted(first) == ["r0", "r1", "r2", "r3"]
    assert place(r, item(9, session="s2")) == first[2]
    r.end_key("session", "s0", 0.0)
    assert place(r, item(10, session="new")) == first[0]


def test_cache_aware_follows_the_prefix_when_balanced_and_the_least_loaded_when_not():
    r = routers(CacheAware)
    prefix = (11, 12, 13, 14)
    home = place(r, item(1), prefix)
    assert place(r, item(2), prefix) == home
    r.load[r.index[home]] = 100  # 100 - 0 > 64 and 100 > 1.5 * 0: imbalanced
    assert place(r, item(3), prefix) != home


def summary(cfg: FleetConfig, router) -> dict:
    f = Fleet(cfg, router)
    row = f.run().summary(f.clients.group_times)
    return {k: v for k, v in row.items() if not k.endswith("_us") and k != "router_other_s"}


def test_a_run_is_deterministic_for_a_seed():
    a, b = summary(SMALL, RoundRobin()), summary(SMALL, RoundRobin())
    assert a == b
    assert summary(replace(SMALL, seed=1), RoundRobin()) != a


def test_every_request_finishes_and_prefilled_is_never_below_ideal():
    for router in (RoundRobin(), CacheAware(), Ours()):
        row = summary(SMALL, router)
        assert row["requests"] >= SMALL.requests - SMALL.workload.group_size
        assert row["prefilled_over_ideal"] >= 1.0
        assert row["prefilled_tokens"] == row["prompt_tokens"] - round(row["hit_rate"] * row["prompt_tokens"])


def test_ours_reuses_more_prefix_than_round_robin():
    ours, rr = summary(SMALL, Ours()), summary(SMALL, RoundRobin())
    assert ours["prefilled_tokens"] < 0.6 * rr["prefilled_tokens"]


def test_a_flush_update_costs_multi_turn_sessions_their_cache_and_keep_does_not():
    cfg = replace(SMALL, kinds=frozenset({"agent"}), update_every=1, weight_policy="flush")
    flush, keep = Fleet(cfg, ConsistentHash("flush")), Fleet(replace(cfg, weight_policy="keep"), ConsistentHash("keep"))
    flush.run()
    keep.run()
    assert len(flush.rec.updates) == len(keep.rec.updates) > 0
    assert flush.rec.summary([])["prefilled_tokens"] > keep.rec.summary([])["prefilled_tokens"]
