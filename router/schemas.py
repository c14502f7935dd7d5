"""Request bodies of the OpenAI-style endpoints as pydantic models, and the OpenAPI document.

The models type every field the router reads; any other OpenAI/vLLM field of a completion or
chat request passes through to the replica untouched (``extra="allow"``; ``/v1/score`` builds
its replica requests itself, so its other fields go nowhere). ``router.parse`` runs its own checks first (they
give each field's long-standing message), then :func:`validate_body`, which reports a model
error as a ``BadRequest`` naming the field (``messages[2].role``, ``max_tokens``).
:func:`openapi_document` builds ``GET /openapi.json`` from the same models.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.json_schema import models_json_schema

from router import package_version
from router.errors import BadRequest

MAX_TOP_LOGPROBS = 20
_BODY = ConfigDict(extra="allow", strict=True, use_attribute_docstrings=True)


class RoutingFields(BaseModel):
    """Routing keys a body may carry (or headers ``X-Session-Id``, ``X-Group-Id``,
    ``X-Weight-Version``); the router removes them before forwarding."""

    model_config = _BODY
    session_id: str | int | None = None
    """A multi-turn session: its turns go to the replica holding its prefix (not empty)."""
    group_id: str | int | None = None
    """A group of samples sharing one prompt (GRPO): kept on one replica (not empty)."""
    weight_version: int | str | None = None
    """The policy weight version the request must run under (an integer >= 0)."""
    end_session: bool | None = None
    """This is the session's last turn: its pin and parked prefix are released when it ends
    (header ``X-Session-End: true``; or ``DELETE /v1/sessions/{session_id}``); needs a session id."""


class TextPart(BaseModel):
    """One content part of a chat message; only text parts are supported."""

    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str
    """The part's text (required, as vLLM requires it)."""


class ChatMessage(BaseModel):
    """One chat message; other OpenAI message fields pass through to the chat template."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[TextPart] | None = None


class _Generation(RoutingFields):
    model: str | None = None
    """Served model name; default: the replicas' model."""
    stream: bool = False
    """Relay server-sent events as the replica produces them."""
    max_tokens: int | None = Field(None, ge=1)
    """Most tokens to generate; prompt + max_tokens must fit ``max_model_len``."""
    n: int | None = Field(None, ge=1)
    """Samples per prompt, at most ``router.max_n``."""


class CompletionRequest(_Generation):
    """``POST /v1/completions``: one prompt as text or token IDs (a batch is refused)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    """Text or token IDs; a one-element list is unwrapped."""
    add_special_tokens: bool = True
    """Add the tokenizer's special tokens (BOS) to a text prompt, as vLLM's completions do."""


class ChatRequest(_Generation):
    """``POST /v1/chat/completions``: messages rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    """Same as ``max_tokens`` (takes precedence, as in vLLM)."""
    add_generation_prompt: bool = True
    """Append the assistant turn's header (the chat template's generation prompt)."""
    continue_final_message: bool = False
    """Leave the last message open for the model to continue; needs add_generation_prompt false."""
    add_special_tokens: bool = False
    """Add special tokens (BOS) on top of what the chat template renders."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables for the chat template (not ``chat_template`` or ``tokenize``)."""
    documents: list[dict[str, str]] | None = None
    """Documents for templates that support retrieval (passed to the chat template)."""
    reasoning_effort: str | None = None
    """Passed to the chat template (and sets ``enable_thinking`` unless given), as vLLM does."""


class ScoreBody(RoutingFields):
    """``POST /v1/score``: log-probabilities of K responses to one context (teacher scoring)."""

    context: str | list[int] | None = None
    """The shared context as text or token IDs (or give ``messages``)."""
    messages: list[ChatMessage] | None = None
    """The shared context as chat messages, rendered with a generation prompt."""
    responses: list[list[int]] = Field(min_length=1)
    """K >= 1 responses, each a non-empty list of token IDs; K at most ``router.max_score_responses``."""
    top_logprobs: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    """Extra top-k alternatives per scored row."""
    model: str | None = None
    """Served model name; default: the replicas' model."""


_TAGS = frozenset({"str", "int", "float", "bool", "none", "list", "dict"})
_REASONS = {"bool_type": "must be a boolean", "int_type": "must be an integer", "string_type": "must be a string",
            "dict_type": "must be an object", "model_type": "must be an object", "list_type": "must be a list",
            "missing": "is required", "too_short": "must not be empty",
            "literal_error": "must be 'text': only text content parts are supported"}


def _fields(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """A pydantic error location without its union-member tags (``"list[int]"``, ``"str"``)."""
    return tuple(p for p in loc if isinstance(p, int) or isinstance(p, str) and p.isidentifier() and p not in _TAGS)


def error_param(loc: tuple[Any, ...]) -> str:
    """The request field a pydantic error location names: ``("messages", 2, "role")`` ->
    ``"messages[2].role"``; union-member tags (``"list[int]"``) are left out."""
    out = ""
    for part in _fields(loc):
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else part
    return out or "body"


def _at_fault(errors: list[Any]) -> Any:
    """The first error, or the one deepest inside its field: where every member of a union fails,
    the member that got furthest into the input says what is wrong (``content: [{"type": "text"}]``
    is missing ``messages[0].content[0].text``, not "must be a string")."""
    field = _fields(tuple(errors[0]["loc"]))
    inside = [e for e in errors if _fields(tuple(e["loc"]))[:len(field)] == field]
    return max(inside, key=lambda e: len(_fields(tuple(e["loc"]))))


PASSED_MAX, PASSED_KEY_BYTES = 1024, 4096
_PASSED: dict[tuple[type[BaseModel], bytes], None] = {}
"""Bodies that passed, by model and the bytes they were decoded from (oldest first, bounded)."""


def validate_body(model: type[BaseModel], body: dict[str, Any], *, source: bytes | None = None) -> None:
    """Validate ``body`` against ``model``; BadRequest naming the first field at fault, in a short
    message of our own (pydantic's is used, first letter lowered, only for a kind not in ``_REASONS``).

    ``source``: bytes ``body`` is a pure function of (``router.body.load_json_split``'s rest of a
    completion, from which the prompt was cut and the routing fields are popped alike every
    time). A body from bytes that passed before passes without pydantic: an RL client sends the
    same sampling fields with every prompt, and validating them cost about 100 us of the router's
    latency in place (3 us in a hot loop: pydantic-core's code and the model's validator are cold
    in the CPU's caches between requests)."""
    key = (model, source) if source is not None and len(source) <= PASSED_KEY_BYTES else None
    if key is not None and key in _PASSED:
        return
    try:
        model.model_validate(body)
    except ValidationError as exc:
        error = _at_fault(exc.errors(include_url=False))
        param = error_param(tuple(error["loc"]))
        reason = _REASONS.get(error["type"]) or error["msg"][:1].lower() + error["msg"][1:]
        raise BadRequest(f"'{param}' {reason}", param=param) from None
    if key is not None:
        if len(_PASSED) >= PASSED_MAX:
            del _PASSED[next(iter(_PASSED))]
        _PASSED[key] = None


ENDPOINTS = {"/v1/completions": (CompletionRequest, "Create a completion (OpenAI completions API)"),
             "/v1/chat/completions": (ChatRequest, "Create a chat completion (OpenAI chat API)"),
             "/v1/score": (ScoreBody, "Score K responses to one context (teacher log-probabilities)")}


ERROR_RESPONSES = {
    "400": "Invalid request: `error.param` names the field",
    "401": "Missing or unknown API key (`router.api_keys`)",
    "403": "The key may not do this (its tenant is fixed, or the tenant header is not allowed)",
    "408": "The body did not arrive within `router.body_timeout_s`",
    "409": "`weight_version` is older than `router.max_staleness` allows",
    "413": "The body is over `router.max_body_bytes`",
    "415": "A `Content-Encoding` the router does not undo",
    "429": "Admission is full (KV cache or queue): retry after `Retry-After` seconds",
    "502": "The replicas failed the request and retries ran out",
    "503": "No replica can take it now, or the router is stopping: retry after `Retry-After` seconds",
}
"""The errors a generation or scoring request can get, each an ``{"error": {...}}`` body."""


@lru_cache(maxsize=1)
def openapi_document() -> dict[str, Any]:
    """The router's OpenAPI 3.1 document: request schemas from the models, errors as
    ``{"error": {"message", "type", "param", "code"}}``."""
    _, defs = models_json_schema([(m, "validation") for m, _ in ENDPOINTS.values()],
                                 ref_template="#/components/schemas/{model}")
    def error(description: str) -> dict[str, Any]:
        return {"description": description,
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}

    errors = {code: error(text) for code, text in ERROR_RESPONSES.items()}
    schemas = {**defs.get("$defs", {}), "Error": _ERROR_SCHEMA}
    paths: dict[str, Any] = {path: {"post": {
        "summary": summary, "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}},
        "responses": {"200": {"description": "The replica's answer, annotated with `rollout_router`"}, **errors}}}
        for path, (model, summary) in ENDPOINTS.items()}
    for path, summary in (("/v1/models", "The served model"), ("/health", "Replica health"),
                          ("/metrics", "Prometheus metrics"), ("/openapi.json", "This document")):
        paths[path] = {"get": {"summary": summary, "responses": {"200": {"description": "OK"}}}}
    paths["/v1/sessions/{session_id}"] = {"delete": {
        "summary": "End a session: its pin and parked prefix are released at once",
        "parameters": [{"name": "session_id", "in": "path", "required": True, "schema": {"type": "string"}}],
        "responses": {"200": {"description": "`{\"session_id\", \"ended\"}`: ended is false for an unknown "
                                             "or already ended session"},
                      **{code: errors[code] for code in ("400", "401", "403")}}}}
    return {"openapi": "3.1.0", "info": {"title": "rollout-router", "version": package_version()},
            "paths": paths, "components": {"schemas": schemas}}


_ERROR_SCHEMA = {"type": "object", "properties": {"error": {"type": "object", "properties": {
    "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
    "code": {"type": "integer"}}}}}
