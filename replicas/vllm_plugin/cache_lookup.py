"""Engine core, cache lookup: bound every prefix-cache hit of a capped request by its cap.

Patches ``KVCacheManager.get_computed_blocks`` (``vllm/v1/core/kv_cache_manager.py``), which
hard-codes ``max_cache_hit_length = request.num_tokens - 1`` and passes it to
``self.coordinator.find_longest_cache_hit(block_hashes, max_cache_hit_length)``. For a request
carrying ``rollout_router_cache_cap`` the wrapper runs vLLM's own ``get_computed_blocks`` with
that one argument lowered to ``min(max_cache_hit_length, cap)``; the full-attention manager
walks ``max_length // block_size`` blocks, so the hit is rounded down to a block as usual.
Every other step (events, stats, block bookkeeping) is vLLM's.

The scheduler calls ``get_computed_blocks`` whenever a request has no computed tokens: at
first admission and again after preemption (``num_computed_tokens`` reset to 0), so the cap
holds on every lookup; chunked prefill continues from the capped hit. The lookups that bypass
``get_computed_blocks`` (``get_computed_blocks_for_connector``, KV connectors, KV offloading)
only run with configurations :mod:`.support` refuses.

Requests without a cap take the untouched original path.
"""

from __future__ import annotations

from typing import Any, Callable

from replicas.vllm_plugin.contract import REQUEST_CACHE_CAP_ATTR
from replicas.vllm_plugin.patching import wrap

LOOKUP_NAME = "find_longest_cache_hit"


def install() -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    wrap(KVCacheManager, "get_computed_blocks", _make_wrapper)


def _make_wrapper(original: Callable) -> Callable:
    def get_computed_blocks(self, request):
        cap = getattr(request, REQUEST_CACHE_CAP_ATTR, None)
        if cap is None:
            return original(self, request)
        coordinator = self.coordinator
        setattr(coordinator, LOOKUP_NAME, bounded_lookup(getattr(coordinator, LOOKUP_NAME), cap))
        try:
            return original(self, request)
        finally:
            delattr(coordinator, LOOKUP_NAME)  # back to the class's method

    return get_computed_blocks


def bounded_lookup(lookup: Callable[..., Any], cap: int) -> Callable[..., Any]:
    """``lookup(block_hashes, max_cache_hit_length)`` with the length lowered to ``cap``."""

    def find_longest_cache_hit(block_hashes, max_cache_hit_length):
        return lookup(block_hashes, min(max_cache_hit_length, cap))

    return find_longest_cache_hit
