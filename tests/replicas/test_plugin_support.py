"""The per-engine support check on fake config objects: pure, no vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from replicas.vllm_plugin.support import ACTIVE, check_engine_support


@dataclass
class FullAttentionSpec:
    sliding_window: int | None = None
    attention_chunk_size: int | None = None


class MLAAttentionSpec(FullAttentionSpec):
    pass


class SlidingWindowSpec:
    sliding_window = 4096


class MambaSpec:
    pass


@dataclass
class Group:
    kv_cache_spec: Any = field(default_factory=FullAttentionSpec)


@dataclass
class KVCacheConfig:
    kv_cache_groups: list = field(default_factory=lambda: [Group()])


@dataclass
class CacheConfig:
    enable_prefix_caching: bool = True
    cache_dtype: str = "auto"
    kv_offloading_size: float | None = None
    kv_sharing_fast_prefill: bool = False


@dataclass
class ModelConfig:
    enable_prompt_embeds: bool = False
    is_multimodal_model: bool = False
    sliding_window: int | None = None

    def get_sliding_window(self):
        return self.sliding_window


@dataclass
class ParallelConfig:
    decode_context_parallel_size: int = 1
    prefill_context_parallel_size: int = 1


@dataclass
class VllmConfig:
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    model_config: ModelConfig = field(default_factory=ModelConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    speculative_config: Any = None
    kv_transfer_config: Any = None
    ec_transfer_config: Any = None
    use_v2_model_runner: bool = False


def check(cfg=None, kv=None, v2_patched=True):
    return check_engine_support(cfg or VllmConfig(), kv or KVCacheConfig(), v2_patched)


def test_plain_text_full_attention_engine_is_supported():
    assert check() == ACTIVE
    assert check(kv=KVCacheConfig([Group(MLAAttentionSpec())])).active
    assert check(VllmConfig(use_v2_model_runner=True)).active


@pytest.mark.parametrize(
    "cfg, needle",
    [
        (VllmConfig(cache_config=CacheConfig(enable_prefix_caching=False)), "prefix caching disabled"),
        (VllmConfig(cache_config=CacheConfig(cache_dtype="fp8")), "kv_cache_dtype=fp8"),
        (VllmConfig(cache_config=CacheConfig(kv_offloading_size=4.0)), "offloading"),
        (VllmConfig(cache_config=CacheConfig(kv_sharing_fast_prefill=True)), "kv_sharing_fast_prefill"),
        (VllmConfig(speculative_config=object()), "speculative decoding"),
        (VllmConfig(kv_transfer_config=object()), "KV connector"),
        (VllmConfig(ec_transfer_config=object()), "encoder cache connector"),
        (VllmConfig(model_config=ModelConfig(enable_prompt_embeds=True)), "prompt embeds"),
        (VllmConfig(model_config=ModelConfig(is_multimodal_model=True)), "multimodal"),
        (VllmConfig(model_config=ModelConfig(sliding_window=4096)), "sliding window"),
        (VllmConfig(parallel_config=ParallelConfig(decode_context_parallel_size=2)), "context parallel"),
    ],
)
def test_unsupported_configs_fall_back_with_a_reason(cfg, needle):
    support = check(cfg)
    assert not support.active
    assert needle in support.reason


@pytest.mark.parametrize(
    "kv, needle",
    [
        (KVCacheConfig([Group(), Group()]), "2 KV cache groups"),
        (KVCacheConfig([]), "0 KV cache groups"),
        (KVCacheConfig([Group(SlidingWindowSpec())]), "SlidingWindowSpec is not full attention"),
        (KVCacheConfig([Group(MambaSpec())]), "MambaSpec is not full attention"),
        (KVCacheConfig([Group(FullAttentionSpec(sliding_window=128))]), "sliding window"),
        (KVCacheConfig([Group(FullAttentionSpec(attention_chunk_size=8192))]), "chunked local"),
    ],
)
def test_unsupported_kv_layouts_fall_back(kv, needle):
    support = check(kv=kv)
    assert not support.active and needle in support.reason


def test_v2_runner_without_its_patch_falls_back():
    support = check(VllmConfig(use_v2_model_runner=True), v2_patched=False)
    assert not support.active and "V2 model runner" in support.reason


def test_first_unsupported_feature_is_reported():
    cfg = VllmConfig(cache_config=CacheConfig(cache_dtype="fp8"), speculative_config=object())
    assert "kv_cache_dtype" in check(replace(cfg)).reason
