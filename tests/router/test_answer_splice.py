"""A replica's 200 answer passed on as its bytes with the ``rollout_router`` member spliced in
(``router.responses.splice_annotation``), its ``usage`` read without decoding the rest
(``router.proxy.UpstreamResult.usage``): checked against decoding the whole body with ``json``."""

from __future__ import annotations

import json

import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from router.proxy import UpstreamResult
from router.responses import splice_annotation

_scalars = (st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1)
            | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8))
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=3)
                       | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=12)
_usage = st.one_of(st.none(), _values, st.fixed_dictionaries(
    {"prompt_tokens": st.integers(0, 10**6), "completion_tokens": st.integers(-2, 10**6) | st.none()},
    optional={"prompt_tokens_details": st.none() | st.fixed_dictionaries(
        {"cached_tokens": st.integers(0, 10**6) | st.none() | st.text(max_size=2)})}))
_objects = st.dictionaries(st.text(max_size=10), _values, max_size=5).flatmap(
    lambda d: st.one_of(st.just(d), _usage.map(lambda u: {**d, "usage": u})))
_layouts = st.sampled_from([(None, (",", ":"), ""), (None, (", ", ": "), "\n"), (2, None, " \r\n"), (None, None, "\t")])
NOTE = {"replica": "r0", "weight_version": 3, "spans": [{"kv_versions": [1, 3]}], "cache_salt": None}


@settings(max_examples=300, deadline=None)
@given(_objects, _layouts)
def test_a_spliced_answer_decodes_as_the_answer_with_the_member_set(obj, layout):
    indent, separators, tail = layout
    raw = (json.dumps(obj, indent=indent, separators=separators) + tail).encode()
    result = UpstreamResult(200, raw)
    usage = obj.get("usage")
    assert result.usage() == (usage if isinstance(usage, dict) else None)
    cached = ((usage if isinstance(usage, dict) else {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    assert result.cached_tokens() == (cached if isinstance(cached, int) else None)
    body = splice_annotation(result, NOTE)
    if "rollout_router" in obj:  # a member of that name: decoded, and ours put in its place
        assert body is None
        return
    assert body is not None and json.loads(body) == {**obj, "rollout_router": NOTE}
    assert body.startswith(raw.rstrip()[:-1].rstrip())  # the replica's bytes, as they came


@given(st.sampled_from([b"", b"[]", b"[1, 2]", b"3", b'"x"', b"null", b'{"a": NaN}', b'{"a": Infinity, "usage": {}}',
                        b"{", b'{"a": 1', b"not json", b'{"a": 1}}', b"\xff{}", b'{"a": 1} x']))
def test_bytes_that_are_no_strict_json_object_are_never_spliced(raw):
    result = UpstreamResult(200, raw)
    assert splice_annotation(result, NOTE) is None
    try:
        payload = json.loads(raw)
    except ValueError:
        payload = None
    if isinstance(payload, dict):  # json reads it (NaN, Infinity): decoded whole, as before
        assert result.payload.keys() == payload.keys() and not result.strict
    assert result.usage() == (payload.get("usage") if isinstance(payload, dict) else None)


def test_an_empty_object_gets_the_member_without_a_comma():
    assert splice_annotation(UpstreamResult(200, b" { }\n"), {"a": 1}) == b' {"rollout_router":{"a":1}}'


@given(st.sampled_from(['"rollout_router"', '"rollout\\u005frouter"', '"\\u0072ollout_router"']))
def test_a_rollout_router_member_however_spelled_is_replaced_not_doubled(key):
    """A fresh attacker's answer held ``"rollout\\u005frouter"``: a byte search missed it and the
    client got the member twice (serde's derived structs refuse a duplicate)."""
    raw = ('{"id": "x", ' + key + ': {"replica": "forged"}, "usage": {"prompt_tokens": 3}}').encode()
    result = UpstreamResult(200, raw)
    assert splice_annotation(result, NOTE) is None and result.payload["rollout_router"] == {"replica": "forged"}
    assert splice_annotation(UpstreamResult(200, b'{"a": {"rollout_router": 1}}'), NOTE) is not None  # nested: no clash


def test_bytes_msgspec_skips_unchecked_are_not_passed_on_as_strict_json():
    """Members the usage-only read skips are not checked for UTF-8 by msgspec."""
    result = UpstreamResult(200, b'{"text": "\xff", "usage": {"prompt_tokens": 1}}')
    assert splice_annotation(result, NOTE) is None and result.payload is None
    assert splice_annotation(UpstreamResult(200, '{"text": "é"}'.encode()), NOTE) is not None


@pytest.mark.parametrize("details", ["[1]", '"x"', "3", "true", '{"cached_tokens": true}', '{"cached_tokens": "4"}'])
def test_usage_of_the_wrong_types_counts_no_cached_tokens(details):
    """A fresh attacker's ``"prompt_tokens_details": [1]`` was a 500 from the router's own code."""
    raw = ('{"usage": {"prompt_tokens": 3, "completion_tokens": true, "prompt_tokens_details": ' + details + '}}').encode()
    result = UpstreamResult(200, raw)
    assert result.cached_tokens() is None and result.completion_tokens() is None


def test_a_body_nested_past_the_stack_is_no_json_not_an_error():
    raw = b'{"a": ' + b"[" * 5000 + b"]" * 5000 + b', "usage": {}}'
    result = UpstreamResult(200, raw)
    splice_annotation(result, NOTE)  # no RecursionError out of msgspec or json
    assert result.cached_tokens() is None
    assert result.payload is None or isinstance(result.payload, dict)
