"""Sentinel rows, the completeness check, trimming and the V2 row offsets: pure torch, no vLLM.

``Rows`` stands in for vLLM's ``LogprobsTensors`` (a NamedTuple with the same three fields).
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np
import torch

from replicas.vllm_plugin.contract import REQUEST_SCORE_START_ATTR
from replicas.vllm_plugin.logprob_rows import (
    SENTINEL_RANK,
    SENTINEL_TOKEN_ID,
    fill_sentinel,
    missing_rows,
    prepend_sentinel_rows,
    trim_rows,
)
from replicas.vllm_plugin.runner_v2 import record_first_rows
from replicas.vllm_plugin.score_check import DELIVERED_ATTR, screen_prompt_logprobs


class Rows(NamedTuple):
    logprob_token_ids: torch.Tensor
    logprobs: torch.Tensor
    selected_token_ranks: torch.Tensor


def sentinel_buffer(num_rows: int, width: int = 1) -> Rows:
    return fill_sentinel(Rows(
        torch.empty(num_rows, width, dtype=torch.int32),
        torch.empty(num_rows, width, dtype=torch.float32),
        torch.empty(num_rows, dtype=torch.int32),
    ))


def write_rows(buf: Rows, start: int, stop: int) -> Rows:
    """What a runner does for computed positions [start, stop): real ids, logprobs, ranks >= 1."""
    n = stop - start
    buf.logprob_token_ids[start:stop] = torch.arange(100, 100 + n, dtype=torch.int32)[:, None]
    buf.logprobs[start:stop] = -torch.arange(1, n + 1, dtype=torch.float32)[:, None]
    buf.selected_token_ranks[start:stop] = torch.arange(1, n + 1, dtype=torch.int32)
    return buf


def test_sentinel_is_rank_minus_one_nan_and_a_valid_id():
    buf = sentinel_buffer(4, width=3)
    assert (buf.selected_token_ranks == SENTINEL_RANK).all()
    assert (buf.logprob_token_ids == SENTINEL_TOKEN_ID).all()
    assert all(math.isnan(x) for x in buf.logprobs.flatten().tolist())


def test_rows_from_s_computed_after_a_capped_hit_are_complete():
    buf = write_rows(sentinel_buffer(2099), 1984, 2099)  # hit 1984 <= S = 1999
    assert missing_rows(buf, 1999) == (0, -1)
    assert missing_rows(buf, 1984).count == 0


def test_rows_under_a_hit_past_s_are_reported_missing():
    buf = write_rows(sentinel_buffer(2099), 2048, 2099)  # uncapped hit 2048 > S = 1999
    missing = missing_rows(buf, 1999)
    assert missing.count == 2048 - 1999 and missing.first == 1999


def test_a_hole_in_the_middle_is_found():
    buf = write_rows(sentinel_buffer(100), 0, 100)
    buf.selected_token_ranks[70] = SENTINEL_RANK
    assert missing_rows(buf, 50) == (1, 70)


def test_trim_keeps_rows_from_s_as_contiguous_copies():
    buf = write_rows(sentinel_buffer(10, width=2), 4, 10)
    out = trim_rows(buf, 6)
    assert out.logprobs.shape == (4, 2) and out.logprobs.is_contiguous()
    assert out.selected_token_ranks.tolist() == [3, 4, 5, 6]
    assert isinstance(out, Rows)


def test_prepend_puts_rows_from_the_hit_at_absolute_positions():
    tail = write_rows(sentinel_buffer(5), 0, 5)  # V2 emits rows H .. N-2 only
    full = prepend_sentinel_rows(tail, 3)
    assert full.selected_token_ranks.tolist() == [-1, -1, -1, 1, 2, 3, 4, 5]
    assert full.logprob_token_ids.dtype == torch.int32 and full.logprobs.shape == (8, 1)
    assert missing_rows(full, 3).count == 0 and missing_rows(full, 2) == (1, 2)
    assert prepend_sentinel_rows(tail, 0) is tail


def test_v2_first_rows_are_recorded_on_the_first_prompt_chunk_only():
    rows: dict[str, int] = {}
    ids = ["a", "b", "c", "d"]
    uses = np.array([True, True, False, True])
    prompt = np.array([2100, 2100, 2100, 300])
    prefill = np.array([2100, 2100, 2100, 301])  # d was resumed after its prompt was done
    record_first_rows(rows, ids, uses, np.array([1984, 0, 0, 0]), prompt, prefill)
    assert rows == {"a": 1984, "b": 0}
    record_first_rows(rows, ids, uses, np.array([2040, 256, 0, 0]), prompt, prefill)  # later chunks
    assert rows == {"a": 1984, "b": 0}
    record_first_rows(rows, ids, uses, np.array([2100, 2100, 0, 0]), prompt, prefill)  # decode
    assert rows == {"a": 1984, "b": 0}


def runner_output(buffers: dict) -> SimpleNamespace:
    return SimpleNamespace(prompt_logprobs_dict=buffers, prompt_token_id_logprobs_dict={})


def scoring_request(s: int | None) -> SimpleNamespace:
    req = SimpleNamespace()
    if s is not None:
        setattr(req, REQUEST_SCORE_START_ATTR, s)
    return req


def test_screen_trims_complete_buffers_and_fails_incomplete_ones():
    good = write_rows(sentinel_buffer(2099), 1984, 2099)
    bad = write_rows(sentinel_buffer(2099), 2048, 2099)
    plain = write_rows(sentinel_buffer(2099), 0, 2099)
    requests = {"good": scoring_request(1999), "bad": scoring_request(1999), "plain": scoring_request(None)}
    out = runner_output({"good": good, "bad": bad, "plain": plain, "gone": None})
    failed = screen_prompt_logprobs(requests, out)
    assert set(failed) == {"bad"} and "49 prompt-logprob rows" in failed["bad"][1]
    assert out.prompt_logprobs_dict["bad"] is None
    assert out.prompt_logprobs_dict["good"].logprobs.shape[0] == 2099 - 1999
    assert out.prompt_logprobs_dict["plain"] is plain  # no S: untouched
    assert getattr(requests["good"], DELIVERED_ATTR) and not hasattr(requests["bad"], DELIVERED_ATTR)


def test_screen_leaves_an_empty_output_alone():
    out = runner_output({})
    assert screen_prompt_logprobs({}, out) == {} and out.prompt_logprobs_dict == {}


def test_v2_wrapper_prepends_the_hit_and_forgets_removed_requests():
    """The V2 wrapper around a stand-in for vLLM's compute_prompt_logprobs (which needs Triton):
    request "a" hits 64 tokens of cache and is prefilled in two chunks; "b" starts cold."""
    from replicas.vllm_plugin.runner_v2 import _make_compute_wrapper, _make_remove_wrapper, first_rows

    emitted: dict[str, Rows] = {}

    def fake_compute(self, logits_fn, hidden, batch, all_ids, computed, prompt_lens):
        return dict(emitted)

    compute = _make_compute_wrapper(fake_compute)
    remove = _make_remove_wrapper(lambda self, req_id: None)
    worker = SimpleNamespace(uses_prompt_logprobs=np.array([True, True]))

    def batch(computed):
        return SimpleNamespace(req_ids=["a", "b"], idx_mapping_np=np.array([0, 1]),
                               num_computed_prefill_tokens_np=np.array(computed),
                               prefill_len_np=np.array([200, 100]))

    prompt_lens = np.array([200, 100])
    assert compute(worker, None, None, batch([64, 0]), None, None, prompt_lens) == {}
    emitted["a"] = write_rows(sentinel_buffer(200 - 1 - 64), 0, 200 - 1 - 64)  # rows 64 .. 198
    out = compute(worker, None, None, batch([128, 0]), None, None, prompt_lens)
    assert out["a"].selected_token_ranks.shape[0] == 199
    assert missing_rows(out["a"], 64).count == 0 and missing_rows(out["a"], 63) == (1, 63)
    assert first_rows(worker) == {"b": 0}
    remove(worker, "b")  # V2 preemption removes and re-adds the request
    assert first_rows(worker) == {}
