"""A completion's token-ID prompt read straight from the JSON bytes (``router.token_ids.split_ids``,
in C) gives the same body, the same refusals and the same forwarded prompt as decoding it whole.

The bodies are generated as text, not only as objects: random whitespace, key order, escapes,
the prompt anywhere among other members, and near-miss prompts (negative, fractional, exponent,
leading zero, out of uint32, nested, empty, the key twice or escaped, trailing garbage)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_policy.native import NATIVE
from router.body import load_json_object
from router.errors import BadRequest
from router.proxy import encode_body, encode_parts
from router.token_ids import TokenIds, split_ids

needs_native = pytest.mark.skipif(NATIVE is None, reason="cache_policy._native is not built (no C compiler)")

WS = st.text(" \t\n\r", max_size=3)
SCALAR = st.one_of(st.integers(-2**70, 2**70), st.floats(allow_nan=False, allow_infinity=False),
                   st.booleans(), st.none(), st.text(max_size=6))
VALUE = st.recursive(SCALAR, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                     st.dictionaries(st.text(max_size=4), inner, max_size=3)),
                     max_leaves=8)
NEAR_MISS = st.sampled_from(["-1", "01", "1.0", "1e3", "4294967296", "99999999999", "[1]", '"1"',
                                     "true", "null", "00", "-0", "1E2", "12345678901234567890"])
ID_TEXT = st.integers(0, 2**32 - 1).map(str)


@st.composite
def id_list_text(draw) -> str:
    items = draw(st.lists(ID_TEXT, min_size=draw(st.sampled_from([0, 1, 1, 1])), max_size=8))
    if items and draw(st.integers(0, 7)) == 0:  # one near miss among valid IDs
        items[draw(st.integers(0, len(items) - 1))] = draw(NEAR_MISS)
    inner = ",".join(draw(WS) + item + draw(WS) for item in items)
    return "[" + (inner or draw(WS)) + "]"


@st.composite
def body_text(draw) -> str:
    members = [json.dumps(k, ensure_ascii=draw(st.integers(0, 5)) == 0) + draw(WS) + ":" + draw(WS) + json.dumps(v)
               for k, v in draw(st.dictionaries(st.sampled_from(["model", "max_tokens", "n", "x", "é", "é", "\\"]),
                                                VALUE, max_size=4)).items()]
    prompt = draw(id_list_text()) if draw(st.integers(0, 4)) else json.dumps(draw(VALUE))
    key = '"prompt"' if draw(st.integers(0, 5)) else draw(st.sampled_from(['"pr\\u006fmpt"', '"promp"']))
    members.insert(draw(st.integers(0, len(members))), key + draw(WS) + ":" + draw(WS) + prompt)
    if draw(st.integers(0, 9)) == 0:
        members.append('"prompt":' + draw(id_list_text()))  # the key twice
    text = "{" + ",".join(draw(WS) + m + draw(WS) for m in members) + "}"
    return draw(WS) + text + draw(st.sampled_from(["", "", "", "", "", " ", "\n", "x", ",", "}"]))


def outcome(raw: bytes, ids_field: str | None):
    try:
        body = load_json_object(raw, ids_field)
    except BadRequest as exc:
        return ("refused", exc.param, str(exc))
    if isinstance(body.get("prompt"), TokenIds):
        body["prompt"] = body["prompt"].tolist()
    return ("ok", body)


@needs_native
@settings(max_examples=1500, deadline=None)
@given(body_text())
def test_reading_the_prompt_from_the_bytes_gives_the_body_decoding_it_whole_gives(text):
    raw = text.encode()
    assert outcome(raw, "prompt") == outcome(raw, None)


@needs_native
@settings(max_examples=500, deadline=None)
@given(body_text())
def test_the_forwarded_body_holds_the_prompt_the_router_hashed(text):
    raw = text.encode()
    try:
        body = load_json_object(raw, "prompt")
    except BadRequest:
        return
    sent = json.loads(encode_body(body))
    want = json.loads(raw)
    assert sent == want
    assert json.loads(b"".join(encode_parts(body))) == want  # what ReplicaClient.post writes, in pieces
    if isinstance(body.get("prompt"), TokenIds):
        assert sent["prompt"] == body["prompt"].tolist() == list(body["prompt"])
        assert body["prompt"].bounds == (min(sent["prompt"]), max(sent["prompt"]))


@needs_native
@pytest.mark.parametrize("text", [
    '{"prompt":[1,2]}', ' { "model" : "m" , "prompt" : [ 0 , 4294967295 ] } ', '{"a":{"prompt":[9]},"prompt":[3]}',
    '{"a":"\\"prompt\\":[1]","prompt":[7,7]}', '{"prompt":[5],"b":[1,{"c":"]}"}]}'])
def test_a_plain_token_id_prompt_is_read_from_the_bytes(text):
    rest, ids, streams = split_ids(text.encode(), "prompt")
    whole = json.loads(text)
    assert ids == whole.pop("prompt") and json.loads(rest) == whole
    assert json.loads(ids.json) == ids.tolist()
    assert not streams


@needs_native
@pytest.mark.parametrize(("text", "streams"), [
    ('{"prompt":[1],"stream":false}', True), ('{"stream":true,"prompt":[1]}', True),
    ('{"prompt":[1],"a":{"stream":true}}', False), ('{"prompt":[1],"a":"\\"stream\\":true"}', False),
    ('{"prompt":[1],"streams":true}', False), ('{"prompt":[1],"strea":true}', False)])
def test_the_split_tells_whether_the_body_has_a_top_level_stream_member(text, streams):
    assert split_ids(text.encode(), "prompt").streams is streams


@needs_native
def test_the_last_split_is_answered_again_for_equal_bytes_only():
    """The lane splits a body; the handler (the lane's, or aiohttp's after a hand-off, which reads
    the body into another bytes object) gets that answer again without a second scan."""
    raw = b'{"prompt":[1,2]}'
    first = split_ids(raw, "prompt")
    assert split_ids(raw, "prompt") is first and split_ids(bytes(bytearray(raw)), "prompt") is first
    assert split_ids(raw, "other") is None  # another key: asked anew
    again = split_ids(raw, "prompt")
    assert again is not first and again == first
    assert split_ids(b'{"prompt":[1,3]}', "prompt").ids == [1, 3]  # other bytes: their own answer


@needs_native
@pytest.mark.parametrize("text", [
    '{"prompt":[]}', '{"prompt":[-1]}', '{"prompt":[01]}', '{"prompt":[1.5]}', '{"prompt":[1e2]}',
    '{"prompt":[4294967296]}', '{"prompt":[[1]]}', '{"prompt":"hi"}', '{"prompt":[1],"prompt":[2]}',
    '{"pr\\u006fmpt":[1]}', '{"prompt":[1]} x', '{"prompt":[1],}', '[{"prompt":[1]}]', '\ufeff{"prompt":[1]}',
    '{"prompt":[1 2]}', '{"prompt":[1,]}', '{"a":1', '{"prompt":[1]'])
def test_anything_else_is_left_to_the_whole_decoder(text):
    assert split_ids(text.encode(), "prompt") is None


def test_token_ids_compare_as_the_list_they_hold():
    ids = TokenIds("I", [3, 4])
    assert ids == [3, 4] and ids != [3, 5] and ids != [3] and ids == TokenIds("I", [3, 4])
    assert {"prompt": ids} == {"prompt": [3, 4]}


FIELD_VALUE = st.one_of(VALUE, st.integers(-3, 5), st.floats(-1, 3), st.sampled_from(["m", "sim", ""]))


@st.composite
def sampling_body(draw) -> bytes:
    fields = draw(st.dictionaries(st.sampled_from(["model", "max_tokens", "add_special_tokens", "stream", "n", "seed",
                                                   "stop", "logprobs", "echo", "x_extra", "session_id"]),
                                  FIELD_VALUE, max_size=5))
    return json.dumps({**fields, "prompt": draw(st.lists(st.integers(0, 1000), min_size=1, max_size=5))}).encode()


def parsed_outcome(raw: bytes, *, remembered: bool):
    from router.body import load_json_split
    from router.parse import default_limits, parse_completion
    try:
        body, source = load_json_split(raw, "prompt")
        parsed = parse_completion(body, {}, limits=default_limits(), source=source if remembered else None)
    except BadRequest as exc:
        return ("refused", exc.param, str(exc))
    return ("ok", {k: v for k, v in parsed.body.items() if k != "prompt"}, parsed.keys)


@needs_native
@settings(max_examples=400, deadline=None)
@given(sampling_body())
def test_a_remembered_validation_answers_as_validating_again(raw):
    """``router.schemas.validate_body`` remembers the rests that passed (by their bytes): the first
    and the second parse of a body, remembered or not, give the same body or the same refusal."""
    fresh = parsed_outcome(raw, remembered=False)
    assert parsed_outcome(raw, remembered=True) == fresh
    assert parsed_outcome(bytes(bytearray(raw)), remembered=True) == fresh  # now remembered, if it passed


@needs_native
def test_only_bytes_that_passed_are_remembered():
    from router.schemas import _PASSED
    good, bad = b'{"model":"m","add_special_tokens":true,"prompt":[1,2]}', b'{"model":"m","add_special_tokens":"x","prompt":[1,2]}'
    assert parsed_outcome(good, remembered=True)[0] == "ok"
    assert any(source == b'{"model":"m","add_special_tokens":true}' for _, source in _PASSED)
    for _ in range(2):
        assert parsed_outcome(bad, remembered=True)[:2] == ("refused", "add_special_tokens")
