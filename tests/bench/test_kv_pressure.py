"""bench.kv_pressure's figures from hand-made records and counters (no replicas)."""

from __future__ import annotations

import re

from bench.client import RequestRecord
from bench.kv_pressure import ROUTERS, has_index, render, summarize
from replicas.metrics import VllmMetrics

BEFORE = {"r0": VllmMetrics(), "r1": VllmMetrics()}
AFTER = {"r0": VllmMetrics(prompt_tokens=300, prefix_cache_hits=64, num_preemptions=1),
         "r1": VllmMetrics(prompt_tokens=200, prefix_cache_hits=32)}


def rec(cached: int, expected: int) -> RequestRecord:
    return RequestRecord("agent", "r0", 250, cached, expected, 0.5, "s0")


def test_only_the_prefix_affinity_routers_have_an_index():
    assert [name for name in ROUTERS if has_index(name)] == ["predicted", "event-fed"]


def test_precision_and_recall_of_an_indexed_router():
    result = summarize("event-fed", [rec(64, 32), rec(32, 64)], BEFORE, AFTER, 1.0)
    assert (result.prompt_tokens, result.prefilled_tokens, result.preemptions) == (500, 404, 1)
    assert (result.precision, result.recall) == (round(64 / 96, 4), round(64 / 96, 4))
    assert summarize("predicted", [rec(64, 0)], BEFORE, AFTER, 1.0).recall == 0.0  # an index that missed


def test_round_robin_has_no_index_so_precision_and_recall_are_n_a():
    rr = summarize("round-robin", [rec(64, 0), rec(32, 0)], BEFORE, AFTER, 1.0)
    assert (rr.precision, rr.recall, rr.cached_tokens) == (None, None, 96)
    ours = summarize("event-fed", [rec(64, 32)], BEFORE, AFTER, 1.0)
    rows = {label: cells for label, *cells in (re.split(r"\s{2,}", line.strip())
                                               for line in render([rr, ours], 1000, 1500).splitlines()[2:])}
    assert rows["index precision"] == ["n/a", "1.0"] and rows["index recall"] == ["n/a", "0.5"]
