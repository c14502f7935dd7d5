"""The KV-budget move rule (issue 14): a pin moves only when staying costs more than moving."""

from __future__ import annotations

import random

import pytest

from cache_policy.affinity import PrefixAffinityPolicy
from cache_policy.config import PolicyConfig
from cache_policy.move_rule import move_target, saturated
from cache_policy.types import Decision, ReplicaId, ReplicaView, RouteReason

BLOCK = 32


def policy(**cfg) -> PrefixAffinityPolicy:
    return PrefixAffinityPolicy(PolicyConfig(**cfg), random.Random(0))


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(30_000) for _ in range(n)]


def pin_sessions(p, fleet, req, home: str, n: int, prompt_len: int) -> list:
    """``n`` sessions whose first turn ran (and finished) on ``home``; returns their next turns."""
    turns = []
    for i in range(n):
        first = req(tokens(prompt_len, i), session_id=f"s{i}")
        p.on_routed(first, Decision(ReplicaId(home), RouteReason.LOAD))
        p.on_finished(first, ReplicaId(home))
        turns.append(req(tokens(prompt_len, i) + [7] * 40, session_id=f"s{i}"))
    return turns


def test_grpo_burst_next_to_an_idle_replica_keeps_pinned_sessions(fleet2, req) -> None:
    p = policy()
    turns = pin_sessions(p, fleet2, req, "a", 8, 640)
    # a 16-request GRPO burst on a: the old rule moved every session (16 > 3 * 0 + 4)
    fleet2.set("a", in_flight=16, num_running=16, kv_cache_usage=0.6, num_gpu_blocks=1000)
    fleet2.set("b", num_gpu_blocks=1000)
    for cache_full_without_queue in (False, True):
        if cache_full_without_queue:
            fleet2.set("a", kv_cache_usage=0.97)  # over the watermark, but nothing waits
        for turn in turns:
            d = p.select(turn, fleet2.list())
            assert (d.replica_id, d.reason, d.matched_blocks) == ("a", RouteReason.SESSION, 20)
    fleet2.set("a", kv_cache_usage=0.5, num_waiting=6)  # a queue, but room in the cache
    assert {p.select(t, fleet2.list()).reason for t in turns} == {RouteReason.SESSION}


def test_saturated_replica_whose_queue_keeps_growing_lets_a_session_go(fleet2, req) -> None:
    cfg = PolicyConfig()
    p = policy()
    [turn] = pin_sessions(p, fleet2, req, "a", 1, 640)  # 20 blocks held on a, none on b
    fleet2.set("a", kv_cache_usage=0.95, num_running=40, num_gpu_blocks=1000)
    fleet2.set("b", kv_cache_usage=0.1, num_gpu_blocks=1000)
    prefill_again = 20 * BLOCK
    seen = []
    for waiting in range(0, 8):
        fleet2.set("a", num_waiting=waiting)
        d = p.select(turn, fleet2.list())
        moves = waiting * cfg.move_queue_cost_tokens > prefill_again
        assert (d.replica_id, d.reason) == (("b", RouteReason.REPIN) if moves else ("a", RouteReason.SESSION))
        seen.append(d.replica_id)
    assert seen.index("b") == prefill_again // cfg.move_queue_cost_tokens + 1  # 3: first wait over 640
    assert d.extra == {"moved_pin": "session", "from": "a"} and d.matched_blocks == 0


def test_replica_holding_the_prefix_takes_the_pin_as_soon_as_the_pinned_one_saturates(fleet2, req) -> None:
    p = policy()
    [turn] = pin_sessions(p, fleet2, req, "a", 1, 640)
    p.index.insert(turn.block_hashes[:20], ReplicaId("b"))
    fleet2.set("a", kv_cache_usage=0.95, num_gpu_blocks=1000, num_waiting=1)
    fleet2.set("b", num_gpu_blocks=1000)
    d = p.select(turn, fleet2.list())
    assert (d.replica_id, d.reason, d.matched_blocks) == ("b", RouteReason.REPIN, 20)


def test_a_session_never_moves_in_the_middle_of_a_request(fleet2, req) -> None:
    p = policy()
    [turn] = pin_sessions(p, fleet2, req, "a", 1, 64)
    p.on_routed(turn, Decision(ReplicaId("a"), RouteReason.SESSION))  # its request runs on a
    fleet2.set("a", kv_cache_usage=0.99, num_gpu_blocks=1000, num_waiting=50)
    fleet2.set("b", num_gpu_blocks=1000)
    assert p.select(turn, fleet2.list()).reason == RouteReason.SESSION
    p.on_finished(turn, ReplicaId("a"))
    assert p.select(turn, fleet2.list()).reason == RouteReason.REPIN


def test_no_move_to_a_replica_that_is_saturated_too(fleet2, req) -> None:
    p = policy()
    [turn] = pin_sessions(p, fleet2, req, "a", 1, 64)
    for rid in ("a", "b"):
        fleet2.set(rid, kv_cache_usage=0.95, num_gpu_blocks=1000, num_waiting=10)
    assert p.select(turn, fleet2.list()).reason == RouteReason.SESSION


@pytest.mark.parametrize("usage, waiting, blocks, expected", [
    (0.80, 1, 1000, False),   # 0.80 + 3 new blocks / 1000 <= 0.85
    (0.849, 1, 1000, True),   # 0.849 + 0.003 > 0.85
    (0.99, 0, 1000, False),   # nothing waits
    (0.99, 5, 0, False),      # capacity unknown
])
def test_saturated(usage, waiting, blocks, expected, req) -> None:
    view = ReplicaView(ReplicaId("a"), kv_cache_usage=usage, num_waiting=waiting, num_gpu_blocks=blocks)
    request = req(tokens(96, 0))  # 3 blocks, none held
    assert saturated(view, request, 0, 0.85) is expected


def test_move_target_weighs_the_target_queue(req) -> None:
    cfg = PolicyConfig(move_queue_cost_tokens=100)
    request = req(tokens(320, 1))  # 10 blocks
    pinned = ReplicaView(ReplicaId("a"), kv_cache_usage=0.95, num_waiting=4, num_gpu_blocks=1000)
    busy = ReplicaView(ReplicaId("b"), kv_cache_usage=0.1, num_waiting=3, num_gpu_blocks=1000)
    idle = ReplicaView(ReplicaId("c"), kv_cache_usage=0.1, num_waiting=0, num_gpu_blocks=1000)
    matched = {ReplicaId("a"): 10, ReplicaId("b"): 10, ReplicaId("c"): 7}
    # stay 400; b: 0 prefilled + 300 queue; c: 3 blocks * 32 = 96 prefilled + 0 queue
    chosen = move_target(pinned, request, [pinned, busy, idle], matched, cfg, random.Random(0))
    assert chosen.replica_id == "c"
    assert move_target(pinned, request, [pinned, busy], matched, cfg, random.Random(0)).replica_id == "b"
    pinned_short_queue = ReplicaView(ReplicaId("a"), kv_cache_usage=0.95, num_waiting=3, num_gpu_blocks=1000)
    assert move_target(pinned_short_queue, request, [busy], matched, cfg, random.Random(0)) is None
