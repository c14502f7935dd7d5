"""Chunk-invariant CPU attention: a prompt row's attention output no longer depends on where
its prefill chunk started, how long the chunk was, or what else was in the batch.

Why: vLLM-CPU's attention kernel (``csrc/cpu/cpu_attn_impl.hpp``) tiles each request's query
rows into outer tiles counted from the chunk's first row, and sizes its KV tiles from the outer
tile's row count. Its online softmax only rescales when the running max grows by more than 8
(the FA4 rule), so a different KV tiling rounds differently. A scoring request that starts after
a cache hit therefore gets rows ~1e-7 off the rows the same prompt gets without the hit, and
those differences grow to ~5e-6 in logprobs over the layers.

How: every request's query rows are handed to the kernel as pieces of at most
``max_q_heads_per_iteration // q_heads_per_kv`` rows, aligned to absolute positions, each piece
a pseudo-request with ``seq_len`` = its last position + 1 and the request's block table. Every
piece then fits one kernel iteration (``one_round``), which fixes the KV tile size for all rows,
and KV tiles start at position 0, so each row sees the same tiles whatever the chunking. The
causal mask is unchanged (a piece's ``seq_len`` ends at its last row) and so is the KV cache
write (``slot_mapping`` is untouched). KV splitting across threads is turned off (it cuts KV at
thread-count-dependent points for one-row pieces).

Measured on this machine's AVX2 ``vec`` kernel (2,300-token sequence, 2 heads of 64): rows from a
hit at any position, with any chunk size, are bit-identical to an uncached run; one pass costs
62 ms vs 72 ms without pieces (one thread).

Opt-in per process: ``ROLLOUT_ROUTER_INVARIANT_ATTENTION=1`` (``replicas`` sets it unless the
replica set says ``invariant_attention=False``). It changes the rounding of every request on
that replica, not only scoring requests. Touches ``CPUAttentionMetadataBuilder.build`` in
``vllm/v1/attention/backends/cpu_attn.py`` only; checked by :data:`TARGETS` before patching.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Any

import torch

from replicas.vllm_plugin import guard, patching
from replicas.vllm_plugin.contract import INVARIANT_ATTENTION_ENV as ENV

logger = logging.getLogger("vllm.rollout_router.invariant_attention")

MAX_Q_HEADS_PER_ITERATION = {"vec": 8, "vec16": 16, "amx": 32}
"""``MaxQHeadNumPerIteration`` of each kernel (``csrc/cpu/cpu_attn_vec.hpp``, ``_vec16.hpp``,
``_amx.hpp``). An ISA not listed gets one-row pieces, which fit any kernel's iteration."""

TARGETS: tuple[guard.Target, ...] = (
    guard.Target("vllm.v1.attention.backends.cpu_attn", "CPUAttentionMetadataBuilder.build",
                 ("self", "common_prefix_len", "common_attn_metadata", "fast_build"),
                 ("ops.cpu_attn_get_scheduler_metadata(", "scheduler_metadata=scheduler_metadata")),
    guard.Target("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl.forward", None,
                 ("query_start_loc=attn_metadata.query_start_loc", "seq_lens=attn_metadata.seq_lens",
                  "block_table=attn_metadata.block_table",
                  "scheduler_metadata=attn_metadata.scheduler_metadata")),
    guard.Target("vllm.v1.attention.backends.cpu_attn", "CPUAttentionMetadata"),
    guard.Target("vllm._custom_ops", "cpu_attn_get_scheduler_metadata"),
)


def enabled() -> bool:
    """Whether this process was asked for chunk-invariant attention (:data:`ENV` = ``"1"``)."""
    return os.environ.get(ENV, "") == "1"


def piece_tokens(isa: str, num_heads: int, num_kv_heads: int) -> int:
    """Rows per piece for kernel ``isa`` (``"vec"``, ``"amx"``, ...): the most that one kernel
    iteration holds, ``max_q_heads // (num_heads // num_kv_heads)``, at least 1."""
    q_heads_per_kv = max(1, num_heads // max(1, num_kv_heads))
    return max(1, MAX_Q_HEADS_PER_ITERATION.get(isa, 1) // q_heads_per_kv)


def split_into_pieces(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                      piece: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Re-describe a batch as pseudo-requests of at most ``piece`` query rows each.

    Args: ``query_start_loc`` int32 ``[num_reqs + 1]`` (row offsets of each request's queries in
    the batch), ``seq_lens`` int32 ``[num_reqs]`` (tokens in each sequence after this step, so
    request i's rows sit at positions ``seq_lens[i] - q_len_i .. seq_lens[i] - 1``),
    ``block_table`` int32 ``[num_reqs, max_blocks]``; ``piece`` >= 1.
    Returns the same three for the pieces, in the same row order: piece boundaries fall on
    multiples of ``piece`` in absolute position, a piece's ``seq_len`` is its last position + 1
    (so causal masking is unchanged) and its block table row is its request's. Requests with no
    query rows give no pieces.
    """
    if piece < 1:
        raise ValueError(f"piece must be >= 1, got {piece}")
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).to(torch.int64)
    ends = seq_lens.to(torch.int64)
    starts = ends - q_lens
    first = torch.div(starts, piece, rounding_mode="floor")
    last = torch.div(ends + piece - 1, piece, rounding_mode="floor")  # exclusive
    counts = torch.where(q_lens > 0, last - first, torch.zeros_like(q_lens))
    req = torch.repeat_interleave(torch.arange(len(q_lens)), counts)
    offsets = torch.arange(int(counts.sum())) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    index = first[req] + offsets
    piece_start = torch.maximum(index * piece, starts[req])
    piece_end = torch.minimum((index + 1) * piece, ends[req])
    new_qsl = torch.zeros(len(req) + 1, dtype=query_start_loc.dtype)
    new_qsl[1:] = query_start_loc[0] + torch.cumsum(piece_end - piece_start, 0)
    return new_qsl, piece_end.to(seq_lens.dtype), block_table[req]


def install() -> None:
    """Wrap ``CPUAttentionMetadataBuilder.build`` so causal decoder attention runs in pieces.
    A no-op unless :func:`enabled`; call only after :data:`TARGETS` passed."""
    if not enabled():
        return
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends import cpu_attn

    def make(build):
        def build_in_pieces(self, common_prefix_len, common_attn_metadata, fast_build=False):
            metadata = build(self, common_prefix_len, common_attn_metadata, fast_build)
            if not _applies(self, metadata):
                return metadata
            piece = piece_tokens(self.isa, self.num_heads, self.num_kv_heads)
            n = common_attn_metadata.num_reqs  # the tensors may carry padding rows past it
            qsl, seq_lens, block_table = split_into_pieces(
                metadata.query_start_loc[: n + 1], metadata.seq_lens[:n], metadata.block_table[:n], piece)
            scheduler_metadata = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=len(seq_lens), num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                head_dim=self.head_dim, seq_lens=seq_lens, dtype=self.dtype, query_start_loc=qsl,
                causal=True, sliding_window_size=self.window_size, isa=self.isa,
                enable_kv_split=False, dynamic_causal=None, kv_cache_dtype=self.kv_cache_dtype)
            return replace(metadata, query_start_loc=qsl, seq_lens=seq_lens, block_table=block_table,
                           scheduler_metadata=scheduler_metadata)
        return build_in_pieces

    patching.wrap(cpu_attn.CPUAttentionMetadataBuilder, "build", make)
    logger.info("rollout_router: chunk-invariant CPU attention on (%s=1)", ENV)


def _applies(builder: Any, metadata: Any) -> bool:
    """Plain causal decoder self-attention without a sliding window; anything else is left as
    vLLM built it."""
    return (metadata.causal is True and metadata.dynamic_causal is None
            and not builder.is_cross_attention and not builder.is_encoder_only_attention
            and builder.window_size == -1 and metadata.encoder_cache is None)
