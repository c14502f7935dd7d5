"""Validate OpenAI-style request bodies and pull out the routing keys.

Routing keys (`session_id`, `group_id`, `weight_version`) come from headers
(`X-Session-Id`, `X-Group-Id`, `X-Weight-Version`) or body fields; body fields are removed
before forwarding, so replicas see a plain OpenAI request. Every error is a `BadRequest`
naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, Mapping

from router.errors import BadRequest

Endpoint = Literal["completions", "chat"]
ROUTING_FIELDS = ("session_id", "group_id", "weight_version")
HEADER_FOR = {"session_id": "X-Session-Id", "group_id": "X-Group-Id", "weight_version": "X-Weight-Version"}


@dataclass(frozen=True)
class RoutingKeys:
    """Affinity keys and the policy weight version a request runs under."""

    session_id: str | None = None
    group_id: str | None = None
    weight_version: int | None = None


@dataclass(frozen=True)
class ParsedRequest:
    """A validated request: ``body`` is what is forwarded (routing fields removed).

    ``prompt`` is the completion prompt (text or token IDs) or None for chat;
    ``messages`` the chat messages or None for completions.
    """

    endpoint: Endpoint
    body: dict[str, Any]
    keys: RoutingKeys
    stream: bool
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None


def load_json_object(raw: bytes) -> dict[str, Any]:
    """Decode a JSON object body; BadRequest on invalid JSON or a non-object."""
    try:
        body = json.loads(raw or b"null")
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}", param="body") from exc
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", param="body")
    return body


def _routing_keys(body: dict[str, Any], headers: Mapping[str, str]) -> RoutingKeys:
    values: dict[str, Any] = {}
    for name in ROUTING_FIELDS:
        value, header = body.pop(name, None), headers.get(HEADER_FOR[name])
        if value is not None and header is not None and str(value) != header:
            raise BadRequest(f"'{name}' is {value!r} in the body but {header!r} in header {HEADER_FOR[name]}; "
                             "send it once", param=name)
        values[name] = header if value is None else value
    for name in ("session_id", "group_id"):
        value = values[name]
        if value is not None and not isinstance(value, (str, int)) or isinstance(value, bool):
            raise BadRequest(f"'{name}' must be a string or an integer", param=name)
        values[name] = None if value is None else str(value)
    version = values["weight_version"]
    if version is not None:
        if isinstance(version, str) and version.strip().isdigit():
            version = int(version)
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise BadRequest(f"'weight_version' must be an integer >= 0, got {version!r}", param="weight_version")
    return RoutingKeys(values["session_id"], values["group_id"], version)


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _validate_prompt(prompt: Any) -> str | list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and (isinstance(prompt[0], str) or _is_token_ids(prompt[0])):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("'prompt' must not be empty", param="prompt")
        return prompt
    if _is_token_ids(prompt):
        if not prompt:
            raise BadRequest("'prompt' must not be empty", param="prompt")
        if min(prompt) < 0:
            raise BadRequest("'prompt' token IDs must be >= 0", param="prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise BadRequest("'prompt' must be one string or one list of token IDs; batched prompts are not "
                         "supported, send one request per prompt", param="prompt")
    if isinstance(prompt, list):
        raise BadRequest("'prompt' token IDs must be integers", param="prompt")
    if prompt is None:
        raise BadRequest("'prompt' is required: a string or a list of token IDs", param="prompt")
    raise BadRequest(f"'prompt' must be a string or a list of token IDs, got {type(prompt).__name__}",
                     param="prompt")


def _validate_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' is required: a non-empty list of {role, content}", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"'messages[{i}].role' must be a string", param=f"messages[{i}].role")
        content = m.get("content")
        if not isinstance(content, (str, list)) and content is not None:
            raise BadRequest(f"'messages[{i}].content' must be a string or a list of parts",
                             param=f"messages[{i}].content")
    return messages


def _validate_common(body: dict[str, Any]) -> bool:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    for name in ("max_tokens", "n"):
        value = body.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise BadRequest(f"'{name}' must be a positive integer", param=name)
    return stream


def parse_completion(body: dict[str, Any], headers: Mapping[str, str]) -> ParsedRequest:
    """Validate a /v1/completions body (mutated: routing fields removed)."""
    keys = _routing_keys(body, headers)
    stream = _validate_common(body)
    prompt = _validate_prompt(body.get("prompt"))
    return ParsedRequest("completions", body, keys, stream, prompt=prompt)


def parse_chat(body: dict[str, Any], headers: Mapping[str, str]) -> ParsedRequest:
    """Validate a /v1/chat/completions body (mutated: routing fields removed)."""
    keys = _routing_keys(body, headers)
    stream = _validate_common(body)
    messages = _validate_messages(body.get("messages"))
    return ParsedRequest("chat", body, keys, stream, messages=messages)
