"""Validate OpenAI-style request bodies and pull out the routing keys.

Routing keys (`session_id`, `group_id`, `weight_version`) come from headers
(`X-Session-Id`, `X-Group-Id`, `X-Weight-Version`) or body fields; body fields are removed
before forwarding, so replicas see a plain OpenAI request. The tenant comes from the edge
(`router.auth`), never from the body. Every error is a `BadRequest` naming the field; checks
that need no tokenizer (sizes against :class:`Limits`) run here, before any work.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal, Mapping, Sequence

import msgspec

from router.auth import one_header
from router.body import is_utf8, load_json_object
from router.errors import BadRequest, echo
from router.schemas import MAX_TOP_LOGPROBS, ChatRequest, CompletionRequest, ScoreBody, validate_body
from router.token_ids import TokenIds, all_ints, min_max

Endpoint = Literal["completions", "chat"]
ROUTING_FIELDS = ("session_id", "group_id", "weight_version")
HEADER_FOR = {"session_id": "X-Session-Id", "group_id": "X-Group-Id", "weight_version": "X-Weight-Version"}
MAX_WEIGHT_VERSION = 2**63 - 1
_DIGITS = re.compile(r"[0-9]{1,19}")
__all__ = ["Limits", "ParsedRequest", "RoutingKeys", "ScoreRequest", "load_json_object", "parse_chat",
           "parse_completion", "parse_score"]


@dataclass(frozen=True)
class Limits:
    """Bounds a request must respect before any work is done on it (from ``AppConfig``)."""

    max_model_len: int
    max_prompt_chars: int
    max_n: int
    max_score_responses: int
    max_key_chars: int

    @classmethod
    def of(cls, cfg: Any, endpoints: Sequence[Any] = ()) -> "Limits":
        """The limits of an ``AppConfig`` in front of ``endpoints`` (``ReplicaEndpoint``s):
        ``max_model_len`` is ``router.max_model_len`` when set, else the smallest one the
        replicas' ``/v1/models`` reported (servers given as ``replicas.urls``: vLLM would refuse
        a longer prompt with its own 400), else ``replicas.max_model_len``."""
        r = cfg.router
        reported = [ep.max_model_len for ep in endpoints if getattr(ep, "max_model_len", None)]
        return cls(cfg.model_len_for(reported), cfg.prompt_chars_for(reported), r.max_n, r.max_score_responses,
                   r.max_key_chars)


@lru_cache(maxsize=1)
def default_limits() -> Limits:
    """The limits of the default ``AppConfig``."""
    from router.config import AppConfig

    return Limits.of(AppConfig())


class RoutingKeys(msgspec.Struct, frozen=True):
    """Affinity keys and the policy weight version a request runs under."""

    session_id: str | None = None
    group_id: str | None = None
    weight_version: int | None = None
    tenant: str | None = None
    """Tenant identity (folded into the cache salt by the decision core)."""
    end_session: bool = False
    """This is the session's last turn: its pin is released when it finishes."""


class ParsedRequest(msgspec.Struct, frozen=True):
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
    prompt_max_id: int | None = None
    """The largest ID of a token-ID prompt, found while its IDs were checked to be ``>= 0``
    (the vocabulary check, ``router.tokenize``, reuses it instead of walking the IDs again)."""


def key_text(name: str, value: Any, limits: Limits) -> str | None:
    """A routing key (``session_id``, ``group_id``) as text; None when absent. BadRequest naming
    ``name`` when it is not a string or integer, empty, longer than ``router.max_key_chars`` or
    not printable (the rules every key follows, in a body, a header or a URL path)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise BadRequest(f"'{name}' must be a string or an integer", param=name)
    text = str(value)
    if not text.strip():
        raise BadRequest(f"'{name}' must not be empty (body field {name} or header {HEADER_FOR[name]}); "
                         "leave it out instead", param=name)
    if len(text) > limits.max_key_chars:
        raise BadRequest(f"'{name}' is {len(text)} characters; at most {limits.max_key_chars}", param=name)
    if not text.isprintable() or not text.isascii() and not is_utf8(text):
        raise BadRequest(f"'{name}' must be printable text", param=name)
    return text


def _weight_version(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, str) and _DIGITS.fullmatch(value.strip()):
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_WEIGHT_VERSION:
        raise BadRequest(f"'weight_version' must be an integer >= 0, got {echo(value)!r}", param="weight_version")
    return value


def routing_keys(body: dict[str, Any], headers: Mapping[str, str], limits: Limits | None = None,
                 tenant: str | None = None) -> RoutingKeys:
    """Pop the routing fields from ``body`` and merge them with their headers (they must agree).

    BadRequest naming the field when a session or group id is empty (or blank), or when
    ``end_session`` / ``X-Session-End`` is true without a session id."""
    limits = limits or default_limits()
    values: dict[str, Any] = {}
    for name in ROUTING_FIELDS:
        value, header = body.pop(name, None), headers.get(HEADER_FOR[name])
        if header is not None:  # sent: once, or every time alike (one_header); absent: no multidict walk
            header = one_header(headers, HEADER_FOR[name], name)
        if value is not None and header is not None and str(value) != header:
            raise BadRequest(f"'{name}' is {echo(value)!r} in the body but {echo(header)!r} in header "
                             f"{HEADER_FOR[name]}; send it once", param=name)
        values[name] = header if value is None else value
    session_id = key_text("session_id", values["session_id"], limits)
    group_id = key_text("group_id", values["group_id"], limits)
    end_session = _end_session(body, headers)
    if end_session and session_id is None:
        raise BadRequest("'end_session' needs a session id: send 'session_id' (or header X-Session-Id) "
                         "with the session's last turn", param="end_session")
    return RoutingKeys(session_id, group_id, _weight_version(values["weight_version"]), tenant, end_session)


def _end_session(body: dict[str, Any], headers: Mapping[str, str]) -> bool:
    """``end_session`` (body, popped) or ``X-Session-End`` (header): this is the session's last turn."""
    value, header = body.pop("end_session", None), headers.get("X-Session-End")
    if header is not None:
        header = one_header(headers, "X-Session-End", "end_session")
    if value is not None and not isinstance(value, bool):
        raise BadRequest("'end_session' must be a boolean", param="end_session")
    if header is not None and header.strip().lower() not in ("true", "false", "1", "0"):
        raise BadRequest("header X-Session-End must be true or false", param="end_session")
    return bool(value) or (header is not None and header.strip().lower() in ("true", "1"))


_routing_keys = routing_keys  # the name router.score imported

ROUTER_SET_FIELDS = {
    "cache_salt": "the router sets cache salts itself, per weight version (README \"Version contract\") and per "
                  "tenant; to keep your requests' cache blocks apart, give them a tenant (an API key's, or "
                  "X-Tenant-Id with router.tenant_header)",
}
"""Fields a client may not send because the router sets them on what it forwards: sent, they were
silently replaced (two clients' different salts shared the router's salt, and its blocks)."""


def refuse_router_set_fields(body: dict[str, Any]) -> None:
    """BadRequest naming the first of :data:`ROUTER_SET_FIELDS` that ``body`` holds."""
    for name, why in ROUTER_SET_FIELDS.items():
        if name in body:
            raise BadRequest(f"'{name}' is not accepted: {why}", param=name)


PLUGIN_XARGS_PREFIX = "rollout_router_"
"""The replica plugin's ``vllm_xargs`` keys (``replicas.vllm_plugin``: ``SCORE_START_KEY``,
``DETOKENIZE_KEY``, the test hooks' ``SKIP_CAP_KEY``) all start so; only the router sets them."""


def refuse_plugin_xargs(body: dict[str, Any]) -> None:
    """BadRequest naming ``vllm_xargs.<key>`` when a client sets one of the replica plugin's keys
    (it moved the scoring cap's start or turned detokenizing off for its own request); any other
    ``vllm_xargs`` key is forwarded as sent."""
    xargs = body.get("vllm_xargs")
    if not isinstance(xargs, dict):
        return
    for key in xargs:
        if isinstance(key, str) and key.startswith(PLUGIN_XARGS_PREFIX):
            param = f"vllm_xargs.{echo(key)}"
            raise BadRequest(f"'{param}' is not accepted: keys starting with {PLUGIN_XARGS_PREFIX!r} are the "
                             "replica plugin's, set by the router itself (scoring: POST /v1/score)", param=param)


def _is_token_ids(value: Any) -> bool:
    return type(value) is TokenIds or (isinstance(value, list) and all_ints(value))


def _validate_prompt(prompt: Any, limits: Limits) -> tuple[str | list[int], int | None]:
    """The prompt, and its largest token ID when it is token IDs."""
    if isinstance(prompt, list) and len(prompt) == 1 and (isinstance(prompt[0], str) or _is_token_ids(prompt[0])):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("'prompt' must not be empty", param="prompt")
        if len(prompt) > limits.max_prompt_chars:
            raise BadRequest(f"'prompt' is {len(prompt)} characters; at most {limits.max_prompt_chars} "
                             "(router.max_prompt_chars)", param="prompt")
        return prompt, None
    if _is_token_ids(prompt):
        return prompt, check_token_ids(prompt, "prompt", limits)
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise BadRequest("'prompt' must be one string or one list of token IDs; batched prompts are not "
                         "supported, send one request per prompt", param="prompt")
    if isinstance(prompt, list):
        raise BadRequest("'prompt' token IDs must be integers", param="prompt")
    if prompt is None:
        raise BadRequest("'prompt' is required: a string or a list of token IDs", param="prompt")
    raise BadRequest(f"'prompt' must be a string or a list of token IDs, got {type(prompt).__name__}",
                     param="prompt")


MAX_TOKEN_ID = 2**32
"""Token IDs are below this (``cache_policy.hashing`` packs them as uint32); without a tokenizer
there is no vocabulary bound, and a larger ID was a 500 from the hashing."""


def check_token_ids(ids: list[int], param: str, limits: Limits) -> int:
    """Non-empty, no longer than the model, every ID >= 0 (the vocabulary bound needs the
    tokenizer); the largest ID."""
    if not ids:
        raise BadRequest(f"'{param}' must not be empty", param=param)
    if len(ids) > limits.max_model_len:
        raise BadRequest(f"'{param}' has {len(ids)} tokens; the model takes at most {limits.max_model_len}",
                         param=param)
    lo, hi = min_max(ids)
    if lo < 0:
        raise BadRequest(f"'{param}' token IDs must be >= 0", param=param)
    if hi >= MAX_TOKEN_ID:  # no vocabulary has one; the block hashes pack IDs as uint32
        raise BadRequest(f"'{param}' holds token ID {hi}; token IDs are below 2**32", param=param)
    return hi


def validate_messages(messages: Any, limits: Limits | None = None) -> list[dict[str, Any]]:
    """Chat messages: a non-empty list of ``{role, content}``, at most ``max_prompt_chars`` of text."""
    limits = limits or default_limits()
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' is required: a non-empty list of {role, content}", param="messages")
    chars = 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"'messages[{i}].role' must be a string", param=f"messages[{i}].role")
        content = m.get("content")
        if not isinstance(content, (str, list)) and content is not None:
            raise BadRequest(f"'messages[{i}].content' must be a string or a list of parts",
                             param=f"messages[{i}].content")
        chars += len(content) if isinstance(content, str) else sum(
            len(p.get("text") or "") if isinstance(p, dict) and isinstance(p.get("text"), str) else 0
            for p in content or ())
    if chars > limits.max_prompt_chars:
        raise BadRequest(f"'messages' hold {chars} characters; at most {limits.max_prompt_chars} "
                         "(router.max_prompt_chars)", param="messages")
    return messages


_validate_messages = validate_messages  # the name router.score imported


def _validate_common(body: dict[str, Any], limits: Limits) -> bool:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    for name in ("max_tokens", "max_completion_tokens", "n"):
        value = body.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise BadRequest(f"'{name}' must be a positive integer", param=name)
    for name in ("max_tokens", "max_completion_tokens"):
        if (body.get(name) or 0) >= limits.max_model_len:
            raise BadRequest(f"'{name}' is {echo(body[name])}; the model's max_model_len is {limits.max_model_len} "
                             "tokens, prompt included", param=name)
    if (body.get("n") or 1) > limits.max_n:
        raise BadRequest(f"'n' is {echo(body['n'])}; at most {limits.max_n} (router.max_n)", param="n")
    if body.get("truncate_prompt_tokens") is not None:
        raise BadRequest("'truncate_prompt_tokens' is not supported: the replica would see other tokens than "
                         "the router routed on; truncate the prompt before sending it",
                         param="truncate_prompt_tokens")
    return stream


def parse_completion(body: dict[str, Any], headers: Mapping[str, str], *, limits: Limits | None = None,
                     tenant: str | None = None, source: bytes | None = None) -> ParsedRequest:
    """Validate a /v1/completions body (mutated: routing fields removed). ``source``: the bytes the
    body but its token-ID prompt was decoded from (``router.body.load_json_split``)."""
    limits = limits or default_limits()
    refuse_router_set_fields(body)
    refuse_plugin_xargs(body)
    if body.get("max_completion_tokens") is not None:
        # vLLM's completions ignore it (a chat field) and generate max_tokens (default 16): the
        # client would get other output than it asked for, and admission would count the wrong size
        raise BadRequest("'max_completion_tokens' is a /v1/chat/completions field; /v1/completions takes "
                         "'max_tokens' (vLLM would ignore it and generate its default 16)",
                         param="max_completion_tokens")
    keys, stream = routing_keys(body, headers, limits, tenant), _validate_common(body, limits)
    prompt, max_id = _validate_prompt(body.get("prompt"), limits)
    # every prompt _validate_prompt passes, the model passes too: it need not walk the token IDs again
    if isinstance(prompt, str):
        validate_body(CompletionRequest, body)
    else:
        validate_body(CompletionRequest, {**body, "prompt": []}, source=source)
    return ParsedRequest("completions", body, keys, stream, prompt=prompt, prompt_max_id=max_id)


def parse_chat(body: dict[str, Any], headers: Mapping[str, str], *, limits: Limits | None = None,
               tenant: str | None = None) -> ParsedRequest:
    """Validate a /v1/chat/completions body (mutated: routing fields removed)."""
    limits = limits or default_limits()
    refuse_router_set_fields(body)
    refuse_plugin_xargs(body)
    keys, stream = routing_keys(body, headers, limits, tenant), _validate_common(body, limits)
    messages = validate_messages(body.get("messages"), limits)
    validate_body(ChatRequest, body)
    _check_chat_rendering(body)
    return ParsedRequest("chat", body, keys, stream, messages=messages)


_REFUSED_CHAT_FIELDS = {
    "tools": "the router cannot yet render tool definitions exactly as vLLM's tool adapter does; render "
             "the prompt yourself and send its token IDs to /v1/completions",
    "chat_template": "the replicas only use the model's own chat template",
}


def _check_chat_rendering(body: dict[str, Any]) -> None:
    """Refuse (400) what the router cannot render the way vLLM renders it, so its hashes match."""
    for name, why in _REFUSED_CHAT_FIELDS.items():
        if body.get(name) is not None:
            raise BadRequest(f"'{name}' is not supported: {why}", param=name)
    kwargs = body.get("chat_template_kwargs") or {}
    bad = sorted({"chat_template", "tokenize", "tools"} & set(kwargs))
    if bad:
        raise BadRequest(f"'chat_template_kwargs' may not set {', '.join(bad)}", param="chat_template_kwargs")
    if body.get("continue_final_message") and body.get("add_generation_prompt", True):
        raise BadRequest("'continue_final_message' needs 'add_generation_prompt': false (vLLM refuses both)",
                         param="continue_final_message")


class ScoreRequest(msgspec.Struct, frozen=True):
    """A validated ``/v1/score`` request (context not yet tokenized if given as text/messages)."""

    context: str | list[int] | None
    messages: list[dict[str, Any]] | None
    responses: list[list[int]]
    top_logprobs: int
    keys: RoutingKeys
    model: str | None
    context_max_id: int | None = None
    """The largest ID of a token-ID context (as ``ParsedRequest.prompt_max_id``)."""


def parse_score(body: dict[str, Any], headers: Mapping[str, str], *, limits: Limits | None = None,
                tenant: str | None = None) -> ScoreRequest:
    """Validate a /v1/score body; BadRequest naming the field."""
    limits = limits or default_limits()
    refuse_router_set_fields(body)
    routing = routing_keys(body, headers, limits, tenant)
    context, messages = body.get("context"), body.get("messages")
    max_id = None
    if (context is None) == (messages is None):
        raise BadRequest("give exactly one of 'context' (token IDs or text) or 'messages'", param="context")
    if messages is not None:
        validate_messages(messages, limits)
    elif not ((isinstance(context, str) or _is_token_ids(context)) and context):
        raise BadRequest("'context' must be a non-empty string or list of token IDs", param="context")
    elif isinstance(context, list):
        max_id = check_token_ids(context, "context", limits)
    elif len(context) > limits.max_prompt_chars:
        raise BadRequest(f"'context' is {len(context)} characters; at most {limits.max_prompt_chars}", param="context")
    responses = body.get("responses")
    if not isinstance(responses, list) or not responses:
        raise BadRequest("'responses' must be a non-empty list of token-ID lists", param="responses")
    if len(responses) > limits.max_score_responses:
        raise BadRequest(f"'responses' holds {len(responses)} responses; at most {limits.max_score_responses} "
                         "(router.max_score_responses)", param="responses")
    for k, r in enumerate(responses):
        if not _is_token_ids(r) or not r or not (0 <= min(r) and max(r) < MAX_TOKEN_ID):
            raise BadRequest(f"'responses[{k}]' must be a non-empty list of token IDs in [0, 2**32)",
                             param=f"responses[{k}]")
    top = body.get("top_logprobs", 0)
    if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise BadRequest(f"'top_logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}]", param="top_logprobs")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string", param="model")
    validate_body(ScoreBody, body)
    return ScoreRequest(context, messages, responses, top, routing, model, context_max_id=max_id)
