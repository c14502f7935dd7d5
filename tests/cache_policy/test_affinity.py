"""PrefixAffinityPolicy: pins, prefix affinity, the balance guard, repinning, spreading."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from cache_policy.affinity import PrefixAffinityPolicy
from cache_policy.config import PolicyConfig
from cache_policy.hashing import block_hashes
from cache_policy.types import Decision, ReplicaId, RouteReason

BLOCK = 32


def policy(seed: int = 0, **cfg) -> PrefixAffinityPolicy:
    return PrefixAffinityPolicy(PolicyConfig(**cfg), random.Random(seed))


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(30_000) for _ in range(n)]


def place(p: PrefixAffinityPolicy, request, rid: str) -> None:
    """Index ``request`` on ``rid`` as if it had been routed there."""
    p.on_routed(request, Decision(ReplicaId(rid), RouteReason.LOAD))


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("n_replicas", [2, 4])
def test_grpo_group_of_16_lands_on_one_replica(seed, n_replicas, new_fleet, req) -> None:
    fleet = new_fleet([f"r{i}" for i in range(n_replicas)])
    p = policy(seed)
    prompt = tokens(200, seed)  # 6 full blocks
    decisions = [fleet.route(p, req(prompt, group_id="g1")) for _ in range(16)]
    chosen = decisions[0].replica_id
    assert all(d.replica_id == chosen for d in decisions)
    assert decisions[0].reason == RouteReason.LOAD and decisions[0].matched_blocks == 0
    assert {d.reason for d in decisions[1:]} == {RouteReason.GROUP}
    assert {d.matched_blocks for d in decisions[1:]} == {6}
    assert fleet.in_flight(chosen) == 16
    p.check_integrity()


def test_burst_without_group_id_is_split_by_the_balance_guard(fleet2, req) -> None:
    p = policy(1)
    prompt = tokens(200, 1)
    decisions = [fleet2.route(p, req(prompt)) for _ in range(6)]
    first = decisions[0].replica_id
    assert [d.replica_id for d in decisions[:5]] == [first] * 5
    assert [d.reason for d in decisions[1:5]] == [RouteReason.PREFIX] * 4
    assert decisions[5].replica_id != first and decisions[5].reason == RouteReason.BALANCE


@pytest.mark.parametrize("with_session_id", [True, False])
def test_session_turns_stay_on_one_replica(with_session_id, new_fleet, req) -> None:
    fleet = new_fleet(["a", "b", "c"])
    p = policy(3)
    kw = {"session_id": "s1"} if with_session_id else {}
    prompt = tokens(300, 0)
    prev_blocks = 0
    seen = []
    for turn in range(6):
        request = req(prompt, **kw)
        decision = fleet.route(p, request)
        seen.append(decision.replica_id)
        assert decision.matched_blocks == prev_blocks
        if turn:
            expected = RouteReason.SESSION if with_session_id else RouteReason.PREFIX
            assert decision.reason == expected
        fleet.finish(p, request, decision.replica_id)
        # keyless background traffic on the other replicas keeps them busy-ish
        others = [r for r in ("a", "b", "c") if r != seen[0]]
        fleet.set(others[turn % 2], in_flight=1)
        prev_blocks = len(block_hashes(prompt, BLOCK))
        prompt = prompt + tokens(90, 100 + turn) + tokens(40, 200 + turn)  # reply + observation
    assert len(set(seen)) == 1


def test_balance_guard(fleet2, hreq) -> None:
    p = policy()
    request = hreq([1, 2, 3, 4])
    place(p, request, "a")

    def route_with(a: int, b: int) -> Decision:
        fleet2.set("a", in_flight=a)
        fleet2.set("b", in_flight=b)
        return p.select(request, fleet2.list())

    assert (route_with(4, 0).replica_id, route_with(4, 0).reason) == ("a", RouteReason.PREFIX)
    d = route_with(20, 0)
    assert (d.replica_id, d.reason, d.matched_blocks) == ("b", RouteReason.BALANCE, 0)
    assert route_with(30, 21).reason == RouteReason.PREFIX  # 30 <= 1.5 * 21
    assert route_with(32, 21).reason == RouteReason.BALANCE  # 32 > 31.5 and 11 > 4
    fleet2.set("a", in_flight=0, num_waiting=9)  # waiting requests count as load
    fleet2.set("b", in_flight=0)
    assert p.select(request, fleet2.list()).reason == RouteReason.BALANCE


def test_balance_guard_keeps_prefix_holder_when_it_is_least_loaded(fleet3, hreq) -> None:
    p = policy()
    request = hreq([1, 2, 3])
    place(p, request, "b")
    fleet3.set("a", in_flight=20)
    d = p.select(request, fleet3.list())
    assert (d.replica_id, d.reason, d.matched_blocks) == ("b", RouteReason.PREFIX, 3)


@pytest.mark.parametrize("seed", range(20))
def test_keyless_distinct_prompts_spread(seed, fleet2, req) -> None:
    p = policy(seed)
    counts = Counter()
    for i in range(40):
        request = req(tokens(100, 1000 * seed + i))
        decision = fleet2.route(p, request)
        assert decision.reason == RouteReason.LOAD
        counts[decision.replica_id] += 1
        fleet2.finish(p, request, decision.replica_id)  # loads stay equal: rng decides
    assert counts["a"] > 0 and counts["b"] > 0


def test_keyless_concurrent_prompts_alternate(fleet2, req) -> None:
    p = policy()
    picks = [fleet2.route(p, req(tokens(64, i))).replica_id for i in range(10)]
    assert Counter(picks) == {"a": 5, "b": 5}


def test_miss_goes_to_less_loaded_despite_bigger_index(fleet2, req, hreq) -> None:
    p = policy()
    for i in range(200):
        place(p, hreq([10_000 + 10 * i + k for k in range(5)]), "a")
    assert p.index.blocks_of(ReplicaId("a")) == 1000
    p.sent.set(ReplicaId("a"), 0.0, 0.0)  # the index is what this is about, not the requests sent
    fleet2.set("a", in_flight=1)
    fleet2.set("b", in_flight=2)
    d = p.select(req(tokens(128, 7)), fleet2.list())
    assert (d.replica_id, d.reason) == ("a", RouteReason.LOAD)
    fleet2.set("a", in_flight=2)
    fleet2.set("b", in_flight=1)
    assert p.select(req(tokens(128, 7)), fleet2.list()).replica_id == "b"


def test_ties_are_broken_by_rng_not_index_size(fleet2, hreq) -> None:
    firsts = Counter()
    for seed in range(40):
        p = policy(seed)
        place(p, hreq(range(100, 150)), "a")  # a much bigger index, same load, as many requests sent
        place(p, hreq([7]), "b")
        firsts[p.select(hreq([1, 2]), fleet2.list()).replica_id] += 1
    assert firsts["a"] > 5 and firsts["b"] > 5


def test_a_new_key_goes_to_the_least_load_plus_requests_sent(fleet2, hreq) -> None:
    for seed in range(20):
        p = policy(seed)
        for i in range(3):
            place(p, hreq([500 + i]), "a")
        place(p, hreq([600]), "b")
        assert (p.sent.get("a", 0.0), p.sent.get("b", 0.0)) == (3, 1)
        assert p.select(hreq([1, 2]), fleet2.list()).replica_id == "b"  # 0 + 1 < 0 + 3
    fleet2.set("b", in_flight=1)
    assert p.select(hreq([1, 2]), fleet2.list()).replica_id == "b"  # 1 + 1 < 0 + 3
    fleet2.set("b", in_flight=3)
    assert p.select(hreq([1, 2]), fleet2.list()).replica_id == "a"  # 3 + 1 > 0 + 3


def test_requests_sent_count_less_as_they_age(fleet2, hreq) -> None:
    # a was sent 3 at t = 0, b 2 at t = 60 (window 60 s): at t = 60 a counts 3/e = 1.10 < 2
    p = policy(balance_window_s=60.0)
    p.pins.advance(0.0)
    for i in range(3):
        place(p, hreq([500 + i]), "a")
    p.pins.advance(60.0)
    for i in range(2):
        place(p, hreq([600 + i]), "b")
    assert p.sent.get("a", 60.0) == pytest.approx(3 / math.e) and p.sent.get("b", 60.0) == pytest.approx(2)
    assert p.select(hreq([1, 2]), fleet2.list()).replica_id == "a"
    undecayed = policy(balance_window_s=1e12)  # about the lifetime totals: b, sent fewer
    for rid, n in (("a", 3), ("b", 2)):
        for i in range(n):
            place(undecayed, hreq([700 + i]), rid)
    assert undecayed.select(hreq([1, 2]), fleet2.list()).replica_id == "b"


def test_a_replica_that_joins_or_comes_back_empty_counts_as_sent_as_few_as_the_least_sent(hreq) -> None:
    p = policy()
    p.on_replicas_changed(["a", "b"])
    for i in range(4):
        place(p, hreq([500 + i]), "a")
    place(p, hreq([600]), "b")

    def counts():
        return {rid: p.sent.get(rid, 0.0) for rid in p.sent}
    p.on_replicas_changed(["a", "b", "c"])  # joins late: not every new key until it has 4
    assert counts() == {"a": 4, "b": 1, "c": 1}
    p.forget_replica("a")  # restarted empty
    assert counts() == {"a": 1, "b": 1, "c": 1}
    p.on_replicas_changed(["b", "c"])
    assert counts() == {"b": 1, "c": 1}


def test_cache_threshold(fleet2, hreq) -> None:
    p = policy()
    place(p, hreq([1, 2]), "a")
    fleet2.set("a", in_flight=1)
    below = p.select(hreq(range(1, 11)), fleet2.list())  # 2 of 10 blocks = 0.2 < 0.3
    assert (below.replica_id, below.reason, below.matched_blocks) == ("b", RouteReason.LOAD, 0)
    place(p, hreq([1, 2, 3]), "a")
    at = p.select(hreq(range(1, 11)), fleet2.list())  # 3 of 10 = 0.3
    assert (at.replica_id, at.reason, at.matched_blocks) == ("a", RouteReason.PREFIX, 3)


def test_pin_moves_to_longest_prefix_healthy_replica(new_fleet, hreq) -> None:
    fleet = new_fleet(["a", "b", "c", "d"])
    p = policy()
    prompt = list(range(1, 7))
    fleet.route(p, hreq(prompt, session_id="s"))  # pins s
    pinned = p.pins.get("session", "s").replica
    others = [r for r in "abcd" if r != pinned]
    place(p, hreq(prompt[:4]), others[0])
    place(p, hreq(prompt[:2]), others[1])
    fleet.set(others[0], in_flight=3)  # the longest prefix wins over load
    fleet.set(pinned, healthy=False)
    d = p.select(hreq(prompt, session_id="s"), fleet.list())
    assert (d.replica_id, d.reason, d.matched_blocks) == (others[0], RouteReason.REPIN, 4)
    assert d.extra == {"moved_pin": "session", "from": pinned}
    p.on_routed(hreq(prompt, session_id="s"), d)
    fleet.set(pinned, healthy=True)
    again = p.select(hreq(prompt, session_id="s"), fleet.list())
    assert (again.replica_id, again.reason) == (others[0], RouteReason.SESSION)


def test_repin_ties_go_to_least_loaded(new_fleet, hreq) -> None:
    fleet = new_fleet(["a", "b", "c"])
    p = policy()
    p.on_routed(hreq([1, 2, 3], session_id="s"), Decision(ReplicaId("a"), RouteReason.LOAD))
    place(p, hreq([1, 2]), "b")
    place(p, hreq([1, 2]), "c")
    fleet.set("b", in_flight=3)
    fleet.set("c", in_flight=1)
    fleet.set("a", healthy=False)
    d = p.select(hreq([1, 2, 3], session_id="s"), fleet.list())
    assert (d.replica_id, d.reason, d.matched_blocks) == ("c", RouteReason.REPIN, 2)


def test_pin_on_absent_replica_moves(fleet2, hreq) -> None:
    p = policy()
    p.on_routed(hreq([1], group_id="g"), Decision(ReplicaId("z"), RouteReason.LOAD))
    d = p.select(hreq([1], group_id="g"), fleet2.list())
    assert d.reason == RouteReason.REPIN and d.extra["moved_pin"] == "group"


def test_group_pin_moves_only_when_its_replica_is_saturated(fleet2, req) -> None:
    p = policy(5)
    prompt = tokens(128, 5)
    members = [req(prompt, group_id="g") for _ in range(16)]
    home = [fleet2.route(p, m) for m in members][-1].replica_id
    other = "b" if home == "a" else "a"
    fleet2.set(home, in_flight=16 + 20)  # load alone never moves a pin (issue 14)
    assert p.select(req(prompt, group_id="g"), fleet2.list()).reason == RouteReason.GROUP
    # saturated (KV over the watermark, one request waiting): 1 * 256 > 4 blocks * 32 to prefill again
    fleet2.set(home, num_gpu_blocks=100, kv_cache_usage=0.95, num_waiting=1)
    late = req(prompt, group_id="g")
    d = p.select(late, fleet2.list())
    assert (d.replica_id, d.reason) == (other, RouteReason.REPIN)
    p.on_routed(late, d)
    assert p.pins.get("group", "g").replica == other
    fleet2.set(other, in_flight=1)
    assert p.select(req(prompt, group_id="g"), fleet2.list()).reason == RouteReason.GROUP


def test_session_repin_does_not_move_group_pin(new_fleet, hreq) -> None:
    fleet = new_fleet(["a", "b", "c"])
    p = policy()
    p.on_routed(hreq([1, 2], group_id="g"), Decision(ReplicaId("b"), RouteReason.LOAD))
    p.on_routed(hreq([1, 2, 3], session_id="s"), Decision(ReplicaId("a"), RouteReason.LOAD))
    place(p, hreq([1, 2, 3]), "c")
    fleet.set("a", healthy=False)
    request = hreq([1, 2, 3], session_id="s", group_id="g")
    d = p.select(request, fleet.list())
    assert (d.replica_id, d.reason, d.extra["moved_pin"]) == ("c", RouteReason.REPIN, "session")
    p.on_routed(request, d)
    assert p.pins.get("session", "s").replica == "c"
    assert p.pins.get("group", "g").replica == "b"


def test_first_turn_of_a_session_follows_its_group(fleet3, hreq) -> None:
    p = policy()
    fleet3.route(p, hreq([1, 2], group_id="g", session_id="s0"))
    home = p.pins.get("group", "g").replica
    for i in range(1, 4):
        d = fleet3.route(p, hreq([1, 2], group_id="g", session_id=f"s{i}"))
        assert (d.replica_id, d.reason) == (home, RouteReason.GROUP)
        assert p.pins.get("session", f"s{i}").replica == home


def test_replicas_changed_drops_pins_and_index(fleet2, hreq) -> None:
    p = policy()
    p.on_routed(hreq([1, 2], session_id="s"), Decision(ReplicaId("a"), RouteReason.LOAD))
    p.on_routed(hreq([1, 3], group_id="g"), Decision(ReplicaId("b"), RouteReason.LOAD))
    p.on_replicas_changed([ReplicaId("b")])
    assert p.pins.get("session", "s") is None and p.pins.get("group", "g").replica == "b"
    assert p.index.match([1, 2]) == {ReplicaId("b"): 1}
    p.check_integrity()


def test_none_when_no_healthy_replica(fleet2, hreq) -> None:
    p = policy()
    fleet2.set("a", healthy=False)
    fleet2.set("b", healthy=False)
    assert p.select(hreq([1], session_id="s"), fleet2.list()) is None
    assert p.select(hreq([1]), []) is None


def test_pins_and_index_are_bounded(fleet3, hreq) -> None:
    p = policy(max_pins=10, max_index_blocks=50)
    for i in range(300):
        request = hreq([i * 7 + k for k in range(5)], session_id=f"s{i}", group_id=f"g{i}")
        d = fleet3.route(p, request)
        fleet3.finish(p, request, d.replica_id)
        assert len(p.pins) <= 10 and len(p.index) <= 50
    p.check_integrity()


def test_finished_releases_own_in_flight(fleet2, req) -> None:
    p = policy()
    members = [req(tokens(64, 1), group_id="g") for _ in range(3)]
    decisions = [fleet2.route(p, m) for m in members]
    assert p.pins.get("group", "g").own_in_flight == 3
    for m, d in zip(members, decisions, strict=True):
        fleet2.finish(p, m, d.replica_id)
    fleet2.finish(p, members[0], decisions[0].replica_id)  # a stray extra release
    assert p.pins.get("group", "g").own_in_flight == 0


def test_a_rejected_request_is_not_predicted_as_a_hit_later() -> None:
    import random

    from cache_policy.affinity import PrefixAffinityPolicy
    from cache_policy.config import PolicyConfig
    from cache_policy.types import BlockHash, ReplicaId, ReplicaView, RequestView

    policy = PrefixAffinityPolicy(PolicyConfig(), random.Random(0))
    replicas = [ReplicaView(ReplicaId("r0")), ReplicaView(ReplicaId("r1"))]
    held = RequestView(tuple(BlockHash(i) for i in range(1, 4)), 96)
    policy.on_routed(held, policy.select(held, replicas))
    longer = RequestView(tuple(BlockHash(i) for i in range(1, 9)), 256)
    decision = policy.select(longer, replicas)
    assert decision.matched_blocks == 3
    policy.on_routed(longer, decision)
    policy.on_rejected(longer, decision)  # e.g. the prompt was too long for the replica
    again = policy.select(longer, replicas)
    assert again.matched_blocks == 3  # the 3 blocks it really holds, not the 8 it refused
