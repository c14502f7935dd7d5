"""Request models, the JSON safety checks, chat-template options and credentials: pure, no engine."""

from __future__ import annotations

import pytest

from router.auth import KeyBook, bearer_token, header_bytes, resolve_tenant, token_matches
from router.body import MAX_JSON_DEPTH, check_tree, load_json_object
from router.errors import readable_validation, BadRequest, RouterError, with_router_param
from router.parse import Limits, parse_chat, parse_completion, parse_score
from router.schemas import ChatRequest, error_param, openapi_document, validate_body
from router.tokenize import template_kwargs

SMALL = Limits(max_model_len=100, max_prompt_chars=50, max_n=4, max_score_responses=3, max_key_chars=8)
HI = [{"role": "user", "content": "hi"}]


def _param(call, *args, **kwargs) -> str:
    with pytest.raises(BadRequest) as err:
        call(*args, **kwargs)
    return err.value.param


def test_error_param_leaves_union_tags_out():
    assert error_param(("messages", 2, "role")) == "messages[2].role"
    assert error_param(("prompt", "list[int]", 1)) == "prompt[1]"
    assert error_param(("content", "str")) == "content" and error_param(()) == "body"


@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"text": "b"}]}]},
     "messages[0].content[1].type"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": ["hi"]}]}, "messages[0].content[0]"),
    ({"messages": HI, "add_generation_prompt": 1}, "add_generation_prompt"),
    ({"messages": HI, "chat_template_kwargs": []}, "chat_template_kwargs"),
    ({"messages": HI, "documents": [{"title": 3}]}, "documents[0].title"),
])
def test_model_errors_name_the_nested_field(body, param):
    assert _param(validate_body, ChatRequest, body) == param


@pytest.mark.parametrize("call,body,headers,param", [
    (parse_completion, {"prompt": [1]}, {"X-Weight-Version": "²"}, "weight_version"),
    (parse_completion, {"prompt": [1]}, {"X-Weight-Version": "1" * 30}, "weight_version"),
    (parse_completion, {"prompt": [1], "session_id": "123456789"}, {}, "session_id"),
    (parse_completion, {"prompt": [1]}, {"X-Group-Id": "a\tb"}, "group_id"),
    (parse_completion, {"prompt": [1], "n": 5}, {}, "n"),
    (parse_completion, {"prompt": [1], "max_tokens": 100}, {}, "max_tokens"),
    (parse_completion, {"prompt": [1], "max_completion_tokens": 5}, {}, "max_completion_tokens"),  # vLLM ignores it
    (parse_completion, {"prompt": [1] * 101}, {}, "prompt"),
    (parse_completion, {"prompt": "x" * 51}, {}, "prompt"),
    (parse_chat, {"messages": [{"role": "user", "content": "x" * 51}]}, {}, "messages"),
    (parse_chat, {"messages": HI, "max_completion_tokens": 0}, {}, "max_completion_tokens"),
    (parse_chat, {"messages": HI, "tools": [{"type": "function"}]}, {}, "tools"),
    (parse_chat, {"messages": HI, "chat_template": "{{ x }}"}, {}, "chat_template"),
    (parse_score, {"context": [1], "responses": [[2]] * 4}, {}, "responses"),
    (parse_score, {"context": "x" * 51, "responses": [[2]]}, {}, "context"),
])
def test_caps_apply_before_any_work(call, body, headers, param):
    assert _param(call, body, headers, limits=SMALL) == param


def test_tenant_is_carried_and_routing_fields_leave_the_body():
    parsed = parse_completion({"prompt": [1], "session_id": 7}, {}, limits=SMALL, tenant="team-a")
    assert (parsed.keys.session_id, parsed.keys.tenant, parsed.body) == ("7", "team-a", {"prompt": [1]})
    assert parse_completion({"prompt": [1]}, {"X-Weight-Version": " 12 "}, limits=SMALL).keys.weight_version == 12


def test_json_bodies_that_would_break_the_router_are_400():
    assert load_json_object(b'{"prompt": "caf\\u00e9"}') == {"prompt": "café"}
    for raw in (b"[" * 5000 + b"]" * 5000, b'{"a": NaN}', b'{"a": -Infinity}'):
        assert _param(load_json_object, raw) == "body"
    assert _param(load_json_object, b'{"n": ' + b"7" * 4400 + b"}") == "n"  # past the digit limit
    assert _param(load_json_object, b'{"m": [{"c": [1, ' + b"7" * 4400 + b"]}]}") == "m[0].c[1]"
    assert _param(load_json_object, b'{"prompt": "\\udc80"}') == "prompt"
    assert _param(load_json_object, b'{"m": [{"c": "ok"}, {"c": "\\ud800x"}]}') == "m[1].c"
    nested: list = []
    for _ in range(MAX_JSON_DEPTH - 1):
        nested = [nested]  # MAX_JSON_DEPTH lists inside each other
    check_tree({"a": nested[0]})  # the object and MAX_JSON_DEPTH - 1 lists: the deepest allowed
    assert _param(check_tree, {"a": nested}) == "a" + "[0]" * (MAX_JSON_DEPTH - 1)


def test_chat_template_variables_merge_as_vllm_merges_them():
    """vllm/entrypoints/openai/chat_completion/protocol.py build_chat_params + renderers/params.py merge_kwargs."""
    assert template_kwargs({}) == {"add_generation_prompt": True, "continue_final_message": False}
    body = {"chat_template_kwargs": {"add_generation_prompt": True, "enable_thinking": True, "x": 1},
            "add_generation_prompt": False, "continue_final_message": True, "reasoning_effort": "low"}
    assert template_kwargs(body) == {"add_generation_prompt": False, "continue_final_message": True,
                                     "enable_thinking": True, "x": 1, "reasoning_effort": "low"}
    assert template_kwargs({"reasoning_effort": "none"})["enable_thinking"] is False
    assert "reasoning_effort" not in template_kwargs({"reasoning_effort": "auto"})


def test_replica_errors_always_name_a_field():
    def fixed(message, param=None):
        return with_router_param({"error": {"message": message, "param": param}}, "chat")["error"]["param"]

    assert fixed("temperature must be non-negative, got -1.0.") == "temperature"
    assert fixed("This model's maximum context length is 16384 tokens", "input_tokens") == "messages"
    assert fixed("Something odd happened") == "body"
    # a pydantic union member's location is no field of ours: the message's field, else the input's
    assert fixed("Input should be a valid dictionary", "0.ChatCompletionMessageFunctionToolCallParam") == "messages"
    assert fixed("bad 'seed' value", "0.SomeParam") == "seed"
    assert fixed("x", "body.messages.0.tool_calls") == "messages[0].tool_calls"
    # vLLM's validation dumps read as clauses naming our fields; anything else stays as it was
    dump = ("2 validation errors:\n  {'type': 'float_parsing', 'loc': ('body', 'temperature'), 'msg': 'Input should be "
            "a valid number', 'input': 'hot'}\n  {'type': 'missing', 'loc': ('body', 'messages', 0, 'role'), "
            "'msg': 'Field required', 'input': {'content': 'x'}}")
    assert readable_validation(dump, "chat") == ("temperature: Input should be a valid number (got 'hot'); "
                                                 "messages[0].role: Field required")
    long = readable_validation("1 validation error:\n  {'loc': ('body', 'logit_bias', '" + "k" * 5000 + "'), 'msg': 'Value "
                               "error, " + "m" * 5000 + "', 'input': '" + "i" * 5000 + "'}", "completions")
    assert len(long) < 450 and long.startswith("logit_bias.kkk") and "..." in long, long
    for odd in ("1 validation error:\n  __import__('os')", "1 validation error:\n  {'msg': 1}", "plain text",
                "1 validation error:\n  {'msg': 'x', 'input': '" + "y" * 30_000 + "'}",
                # a hex int of 16,000 digits: literal_eval takes it, str() of it raises (an attacker's 500)
                "1 validation error:\n  {'type': 't', 'loc': ('body', 0x" + "f" * 4000 + "), 'msg': 'bad'}"):
        assert readable_validation(odd, "chat") == odd
    # vLLM checks a chat's top_logprobs as its own `logprobs` (a fresh user's report: named the bool)
    too_many = "Requested sample logprobs of 100, which is greater than max allowed: 20 (parameter=logprobs, value=100)"
    assert fixed(too_many, "logprobs") == "top_logprobs"
    assert fixed("Input should be a valid boolean", "body.logprobs") == "logprobs"
    assert with_router_param({"error": {"message": too_many, "param": "logprobs"}}, "completions")["error"]["param"] == "logprobs"
    answer = {"error": {"message": "Bad", "type": "BadRequestError", "param": "body.n", "code": 400}}
    assert with_router_param(answer, "completions", 400)["error"] == {
        "message": "Bad", "type": "invalid_request_error", "param": "n", "code": 400}
    assert with_router_param(answer, "completions", 404)["error"]["type"] == "invalid_request_error"


def test_tokens_are_compared_as_bytes_for_any_byte_string():
    assert header_bytes("\udcff\udcfe") == b"\xff\xfe" and header_bytes("é") == "é".encode()
    assert bearer_token({"Authorization": "Bearer \udce2\udc82\udcac"}) == b"\xe2\x82\xac"
    assert token_matches(b"s\xc3\xa9cret", "sécret") and not token_matches(b"\xff", "secret")
    assert not token_matches(None, "x") and not token_matches(b"x", None)
    book = KeyBook({"k-a": "team-a", "k-b": None})
    assert book.tenant_of({"Authorization": "Bearer k-a"}) == "team-a"
    assert book.tenant_of({"authorization": "bearer k-b"}.__class__({"Authorization": "bearer k-b"})) is None
    for headers in ({}, {"Authorization": "Bearer k-c"}, {"Authorization": "Basic k-a"},
                    {"Authorization": "Bearer \udcff"}):
        with pytest.raises(RouterError) as err:
            book.tenant_of(headers)
        assert err.value.status == 401


def test_tenant_header_rules():
    book = KeyBook({"k-a": "team-a"})
    key = {"Authorization": "Bearer k-a"}
    assert resolve_tenant(key, book, header_allowed=False, max_chars=8) == "team-a"
    assert resolve_tenant({**key, "X-Tenant-Id": "team-a"}, book, header_allowed=True, max_chars=8) == "team-a"
    assert resolve_tenant({"X-Tenant-Id": "t"}, KeyBook({}), header_allowed=True, max_chars=8) == "t"
    for headers, allowed, status in (({**key, "X-Tenant-Id": "team-b"}, True, 403),
                                     ({"X-Tenant-Id": "t"}, False, 400), ({"X-Tenant-Id": "t" * 9}, True, 400),
                                     ({"X-Tenant-Id": "t\udcff"}, True, 400)):
        with pytest.raises(RouterError) as err:
            resolve_tenant(headers, KeyBook({}) if "Authorization" not in headers else book,
                           header_allowed=allowed, max_chars=8)
        assert (err.value.status, err.value.param) == (status, "tenant")


def test_openapi_document_is_built_from_the_models():
    doc = openapi_document()
    chat = doc["components"]["schemas"]["ChatRequest"]
    assert chat["required"] == ["messages"]
    assert "generation prompt" in chat["properties"]["add_generation_prompt"]["description"]
    assert doc["paths"]["/v1/score"]["post"]["responses"]["400"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/Error"}
    # each error its own description (all read "Invalid request" before a fresh user's report)
    responses = doc["paths"]["/v1/completions"]["post"]["responses"]
    assert {"400", "401", "403", "408", "409", "413", "415", "429", "502", "503"} <= set(responses)
    assert "Retry-After" in responses["429"]["description"] and "max_body_bytes" in responses["413"]["description"]
    assert len({r["description"] for r in responses.values()}) == len(responses)


@pytest.mark.parametrize("body,want", [
    ({"max_tokens": 7}, 7), ({"max_completion_tokens": 9}, 9),
    ({"max_tokens": 7, "max_completion_tokens": 9}, 9),  # vLLM's chat: max_completion_tokens first
    ({"max_tokens": 7, "max_completion_tokens": None}, 7), ({}, 50), ({"max_tokens": 3, "n": 4}, 12),
])
def test_admission_counts_the_output_vllm_will_generate(body, want):
    from router.generate import new_tokens

    assert new_tokens(body, 50) == want
