"""Admission (S and the cap onto the engine's Request) and the capped lookup, on stand-in
objects: pure, no vLLM."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from replicas.vllm_plugin.admission import admit_scoring_request
from replicas.vllm_plugin.cache_lookup import _make_wrapper
from replicas.vllm_plugin.contract import REQUEST_CACHE_CAP_ATTR, REQUEST_SCORE_START_ATTR, SCORE_START_KEY
from replicas.vllm_plugin.testing_hooks import SKIP_CAP_KEY, TEST_HOOKS_ENV


def request(s=2047, n=2100, prompt_logprobs=0, token_ids=None, start=None, embeds=None, mm=(), extra=None):
    extra_args = {SCORE_START_KEY: s, **(extra or {})}
    params = SimpleNamespace(prompt_logprobs=prompt_logprobs, prompt_logprob_token_ids=token_ids,
                             prompt_logprob_start=start, extra_args=extra_args)
    return SimpleNamespace(request_id="r", sampling_params=params, num_prompt_tokens=n, num_tokens=n,
                           prompt_token_ids=None if embeds is not None else [1] * n,
                           prompt_embeds=embeds, mm_features=list(mm), skip_reading_prefix_cache=True)


def capped(req) -> tuple:
    return (getattr(req, REQUEST_SCORE_START_ATTR, None), getattr(req, REQUEST_CACHE_CAP_ATTR, None),
            req.skip_reading_prefix_cache)


def test_a_scoring_request_gets_s_the_cap_and_cache_reads():
    req = request(prompt_logprobs=0)  # 0 is a scoring request too
    admit_scoring_request(req, engine_supported=True)
    assert capped(req) == (2047, 2047, False)
    assert req.sampling_params.extra_args == {SCORE_START_KEY: 2047}  # the caller's params untouched


def test_token_id_scoring_is_capped_at_prompt_logprob_start():
    req = request(s=2047, prompt_logprobs=None, token_ids=[[5]] * 52, start=2000)
    admit_scoring_request(req, engine_supported=True)
    assert capped(req) == (2047, 2000, False)


@pytest.mark.parametrize(
    "req, supported",
    [
        (request(), False),  # the engine falls back
        (request(prompt_logprobs=None), True),  # not a scoring request
        (request(s=2099), True),  # leaves no scored row (front end answers 400 first)
        (request(s="7"), True),
        (request(embeds=[0.0] * 2100), True),
        (request(mm=[object()]), True),
    ],
)
def test_everything_else_keeps_vllms_behaviour(req, supported):
    admit_scoring_request(req, engine_supported=supported)
    assert capped(req) == (None, None, True)


def test_the_test_only_flag_needs_the_environment(monkeypatch):
    monkeypatch.delenv(TEST_HOOKS_ENV, raising=False)
    req = request(extra={SKIP_CAP_KEY: True})
    admit_scoring_request(req, engine_supported=True)
    assert capped(req) == (2047, 2047, False)  # ignored without the env var
    monkeypatch.setenv(TEST_HOOKS_ENV, "1")
    req = request(extra={SKIP_CAP_KEY: True})
    admit_scoring_request(req, engine_supported=True)
    assert capped(req) == (2047, None, False)  # reads on, cap bypassed: rows will be incomplete


class Coordinator:
    def find_longest_cache_hit(self, block_hashes, max_cache_hit_length):
        return max_cache_hit_length


def fake_get_computed_blocks(manager, req):
    """What vLLM's get_computed_blocks does with the length: num_tokens - 1, to the coordinator."""
    return manager.coordinator.find_longest_cache_hit(req.block_hashes, req.num_tokens - 1)


def test_the_lookup_length_is_lowered_to_the_cap_only_for_capped_requests():
    lookup = _make_wrapper(fake_get_computed_blocks)
    manager = SimpleNamespace(coordinator=Coordinator())
    plain = SimpleNamespace(block_hashes=[], num_tokens=2100)
    assert lookup(manager, plain) == 2099
    capped_req = SimpleNamespace(block_hashes=[], num_tokens=2100, **{REQUEST_CACHE_CAP_ATTR: 2047})
    assert lookup(manager, capped_req) == 2047
    assert "find_longest_cache_hit" not in vars(manager.coordinator)  # restored
    assert lookup(manager, plain) == 2099
