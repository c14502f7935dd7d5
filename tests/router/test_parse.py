"""Request validation: every rejection names the offending field; routing keys are stripped."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.errors import BadRequest
from router.parse import load_json_object, parse_chat, parse_completion
from router.score import parse_score


def test_routing_keys_from_body_are_removed_before_forwarding():
    body = {"prompt": [1, 2, 3], "session_id": "s1", "group_id": 7, "weight_version": "3"}
    parsed = parse_completion(body, {})
    assert parsed.keys.session_id == "s1" and parsed.keys.group_id == "7" and parsed.keys.weight_version == 3
    assert set(parsed.body) == {"prompt"}


def test_routing_keys_from_headers():
    parsed = parse_completion({"prompt": "hi"}, {"X-Session-Id": "abc", "X-Group-Id": "g", "X-Weight-Version": "2"})
    assert (parsed.keys.session_id, parsed.keys.group_id, parsed.keys.weight_version) == ("abc", "g", 2)


def test_a_routing_key_sent_twice_must_agree():
    same = parse_completion({"prompt": "hi", "session_id": 5}, {"X-Session-Id": "5"})
    assert same.keys.session_id == "5"
    with pytest.raises(BadRequest, match="X-Session-Id") as err:
        parse_completion({"prompt": "hi", "session_id": "b"}, {"X-Session-Id": "a"})
    assert err.value.param == "session_id"
    with pytest.raises(BadRequest) as err:
        parse_completion({"prompt": "hi", "weight_version": 2}, {"X-Weight-Version": "3"})
    assert err.value.param == "weight_version"


def test_replica_field_names_become_ours():
    from router.errors import router_param, with_router_param

    assert router_param("input_tokens", "score") == "context" and router_param("input_tokens", "chat") == "messages"
    assert router_param("body.model", "completions") == "model" and router_param("temperature", "chat") == "temperature"
    assert router_param(None, "score") is None
    answer = {"error": {"message": "too long", "param": "input_tokens", "code": 400}}
    assert with_router_param(answer, "completions")["error"] == {"message": "too long", "param": "prompt", "code": 400}
    assert answer["error"]["param"] == "input_tokens"  # not mutated


def test_replica_location_prefixes_are_dropped():
    from router.errors import router_param, with_router_param

    assert router_param("body.seed", "completions") == "seed"
    assert router_param("body.messages.0.content", "chat") == "messages[0].content"
    assert router_param("body.input_tokens", "score") == "context"
    assert router_param("body", "chat") == "body" and router_param("bodyguard.x", "chat") == "bodyguard.x"
    answer = {"error": {"message": "bad seed", "param": "body.seed", "code": 400}}
    assert with_router_param(answer, "completions")["error"]["param"] == "seed"


def test_single_element_prompt_list_is_unwrapped():
    assert parse_completion({"prompt": [[5, 6]]}, {}).prompt == [5, 6]
    assert parse_completion({"prompt": ["text"]}, {}).prompt == "text"


@pytest.mark.parametrize("body,param", [
    ({}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, True]}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": "x", "n": -1}, "n"),
    ({"prompt": "x", "session_id": {"a": 1}}, "session_id"),
    ({"prompt": "x", "weight_version": -3}, "weight_version"),
    ({"prompt": "x", "weight_version": float("inf")}, "weight_version"),
    ({"prompt": "x", "weight_version": True}, "weight_version"),
])
def test_completion_errors_name_the_field(body, param):
    with pytest.raises(BadRequest) as err:
        parse_completion(body, {})
    assert err.value.param == param and err.value.status == 400


@pytest.mark.parametrize("body,param", [
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
])
def test_chat_errors_name_the_field(body, param):
    with pytest.raises(BadRequest) as err:
        parse_chat(body, {})
    assert err.value.param == param


@pytest.mark.parametrize("raw", [b"", b"[1, 2]", b"{bad", b"\xff\xfe"])
def test_body_must_be_a_json_object(raw):
    with pytest.raises(BadRequest) as err:
        load_json_object(raw)
    assert err.value.param == "body"


@pytest.mark.parametrize("body,param", [
    ({"responses": [[1]]}, "context"),
    ({"context": [1], "messages": [{"role": "user", "content": "x"}], "responses": [[1]]}, "context"),
    ({"context": [1, 2]}, "responses"),
    ({"context": [1, 2], "responses": []}, "responses"),
    ({"context": [1, 2], "responses": [[1], []]}, "responses[1]"),
    ({"context": [1, 2], "responses": [[1]], "top_logprobs": 99}, "top_logprobs"),
    ({"context": [9, -5], "responses": [[30]]}, "context"),
    ({"context": [9], "responses": [[30]], "model": 7}, "model"),
])
def test_score_errors_name_the_field(body, param):
    with pytest.raises(BadRequest) as err:
        parse_score(body, {})
    assert err.value.param == param


def test_end_session_comes_from_the_body_or_a_header_and_is_checked():
    from router.errors import BadRequest
    from router.parse import routing_keys

    assert routing_keys({"end_session": True, "session_id": "s"}, {}).end_session is True
    assert routing_keys({}, {"X-Session-End": "true", "X-Session-Id": "s"}).end_session is True
    body = {"end_session": False, "prompt": [1]}
    assert routing_keys(body, {}).end_session is False and "end_session" not in body  # never forwarded
    for bad_body, bad_headers in (({"end_session": "yes"}, {}), ({}, {"X-Session-End": "maybe"})):
        try:
            routing_keys(bad_body, bad_headers)
        except BadRequest as exc:
            assert exc.param == "end_session"
        else:
            raise AssertionError("accepted a bad end_session")


@pytest.mark.parametrize("body,headers,param,header", [
    ({"session_id": ""}, {}, "session_id", "X-Session-Id"),
    ({}, {"X-Session-Id": ""}, "session_id", "X-Session-Id"),
    ({"session_id": "  "}, {}, "session_id", "X-Session-Id"),
    ({"group_id": ""}, {}, "group_id", "X-Group-Id"),
    ({}, {"X-Group-Id": ""}, "group_id", "X-Group-Id"),
])
def test_an_empty_session_or_group_id_is_400_naming_it(body, headers, param, header):
    with pytest.raises(BadRequest) as err:
        parse_completion({"prompt": [1], **body}, headers)
    assert (err.value.status, err.value.param) == (400, param)
    assert f"'{param}' must not be empty" in err.value.message and header in err.value.message


@pytest.mark.parametrize("body,headers", [({"end_session": True}, {}), ({}, {"X-Session-End": "true"}),
                                          ({"end_session": True, "group_id": "g"}, {})])
def test_end_session_without_a_session_id_is_400(body, headers):
    with pytest.raises(BadRequest) as err:
        parse_completion({"prompt": [1], **body}, headers)
    assert (err.value.status, err.value.param) == (400, "end_session")
    assert "'end_session' needs a session id" in err.value.message
    assert parse_completion({"prompt": [1], "end_session": False}, {}).keys.end_session is False


@pytest.mark.parametrize("body,headers,param", [
    ({"n": int("9" * 4000)}, {}, "n"),
    ({"max_tokens": int("9" * 4000)}, {}, "max_tokens"),
    ({"weight_version": "9" * 5000}, {}, "weight_version"),
    ({"session_id": "a" * 5000}, {"X-Session-Id": "b" * 5000}, "session_id"),
])
def test_echoed_input_is_cut_to_about_100_characters(body, headers, param):
    with pytest.raises(BadRequest) as err:
        parse_completion({"prompt": [1], **body}, headers)
    assert (err.value.status, err.value.param) == (400, param)
    assert len(err.value.message) < 300 and "..." in err.value.message, err.value.message


def test_echo_cuts_long_input_with_an_ellipsis():
    from router.errors import echo

    assert echo("short") == "short" and echo(12) == "12"
    assert echo("x" * 101) == "x" * 100 + "..." and echo(int("7" * 4000)) == "7" * 100 + "..."


_FIELD = st.from_regex(r"[a-z_]{1,8}", fullmatch=True)
_OUTSIDE = st.one_of(st.integers(max_value=-(2**63) - 1), st.integers(min_value=2**63))


@settings(max_examples=200, deadline=None)
@given(field=_FIELD, value=_OUTSIDE, nest=st.integers(0, 3), prompt=st.lists(st.integers(0, 2**32 - 1), max_size=50))
def test_an_integer_outside_64_bits_anywhere_is_a_400_naming_its_field(field, value, nest, prompt):
    # vLLM answered HTTP 500 to top_k of 10**30, and the router retried it on every replica
    path, inner = field, value
    for depth in range(nest):  # wrap it: a dict, a list of ints, a list of dicts
        kind = depth % 3
        inner = {"k": inner} if kind == 0 else [1, inner] if kind == 1 else [{"x": 1}, inner]
    body = {"prompt": prompt, field: inner}
    for depth in reversed(range(nest)):  # an int in a list names the list; a container in one, its index
        path += ".k" if depth % 3 == 0 else "" if depth == 0 else "[1]"
    for ids_field in (None, "prompt"):  # decoded whole, and with a token-ID prompt read apart (split_ids)
        with pytest.raises(BadRequest) as err:
            load_json_object(json.dumps(body).encode(), ids_field)
        assert err.value.status == 400 and err.value.param == path, (body, err.value.param)


@settings(max_examples=200, deadline=None)
@given(ints=st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=20), field=_FIELD)
def test_integers_within_64_bits_pass(ints, field):
    body = {"prompt": ints, field: {"n": ints[0], "l": ints}}
    assert load_json_object(json.dumps(body).encode()) == body
    split = {"prompt": [abs(i) % 2**32 for i in ints], field: {"n": ints[0], "l": ints}}
    assert load_json_object(json.dumps(split).encode(), "prompt") == split
