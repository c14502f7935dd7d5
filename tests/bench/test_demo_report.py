"""The demo's summary of one run: counters from each replica's metrics, per replica."""

from __future__ import annotations

from rich.console import Console

from bench.client import RequestRecord
from bench.demo import _summarize, render
from replicas.metrics import VllmMetrics


def _record(replica: str) -> RequestRecord:
    return RequestRecord("grpo", replica, 100, 0, 0, 0.1, "k")


def test_summary_shows_requests_and_prefilled_tokens_per_replica():
    """Both routers spread requests evenly, so the table shows what differs per replica too: the
    prompt tokens each one computed (its counters' prompt tokens minus prefix-cache hits)."""
    before = {"r0": VllmMetrics(prompt_tokens=1_000, prefix_cache_hits=200),
              "r1": VllmMetrics(prompt_tokens=50, prefix_cache_hits=0)}
    after = {"r0": VllmMetrics(prompt_tokens=5_000, prefix_cache_hits=3_200),
             "r1": VllmMetrics(prompt_tokens=4_050, prefix_cache_hits=1_000)}
    records = [_record("r0")] * 3 + [_record("r1")] * 2
    result = _summarize("grpo", "prefix_affinity", records, before, after, 1.0)
    assert result.prompt_tokens == 8_000 and result.prefix_cache_hits == 4_000 and result.prefilled_tokens == 4_000
    assert result.requests_per_replica == {"r0": 3, "r1": 2}
    assert result.prefilled_per_replica == {"r0": 1_000, "r1": 3_000}
    console = Console(record=True, width=200)
    render([result], console)
    text = console.export_text()
    lines = text.splitlines()  # one line per replica in the cell
    assert any("r0: 3 / 1,000" in line for line in lines) and any("r1: 2 / 3,000" in line for line in lines)
    assert not any("r0: 3 / 1,000" in line and "r1:" in line for line in lines)
