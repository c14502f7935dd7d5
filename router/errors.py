"""Domain errors and the one middleware that turns them into OpenAI-style JSON errors.

Caller mistakes are 4xx naming the field (input they quote is cut short by :func:`echo`); a
replica failure that cannot be retried is 502; no eligible replica is 503; an overloaded router
is 429 with Retry-After. The router's own code never answers 5xx to a request on purpose: an
exception nobody expected is the last line, a 500 carrying an error id that is logged with its
traceback, never aiohttp's bare page. Every error body the router writes itself comes from
:func:`error_body`, its ``type`` from the status alone (:func:`error_type`, OpenAI's names).
"""

from __future__ import annotations

import ast
import json
import logging
import re
import uuid

from aiohttp import web

log = logging.getLogger(__name__)


ECHO_CHARS = 100
"""Most characters of a client's input an error message quotes (:func:`echo`)."""


def echo(value: object, limit: int = ECHO_CHARS) -> str:
    """``value`` (a client's input) as an error message quotes it: its text, cut to ``limit``
    characters followed by ``...`` when longer, so a 4,000-digit number or a long id never comes
    back whole. Every message that echoes input goes through here."""
    try:
        text = value if isinstance(value, str) else str(value)
    except ValueError:  # an int past Python's digit limit for str()
        return f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:limit] + "..."


ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}
"""OpenAI's error ``type`` for the statuses that have their own (its SDK's ``AuthenticationError``,
``PermissionDeniedError``, ``RateLimitError``); any other 4xx is ``invalid_request_error``, any
5xx ``server_error`` (:func:`error_type`)."""


def error_type(status: int) -> str:
    """The ``error.type`` of every error body the router writes with HTTP ``status``."""
    return ERROR_TYPES.get(status) or ("invalid_request_error" if status < 500 else "server_error")


def error_body(status: int, message: str, *, param: str | None = None) -> dict:
    """An OpenAI-style error body, ``{"error": {"message", "type", "param", "code"}}``: the one
    place the router builds one (``code`` is the HTTP status, ``type`` :func:`error_type`)."""
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": status}}


class RouterError(Exception):
    """Base: ``status`` is the HTTP status, ``param`` the offending request field if any; the
    error ``type`` follows from the status (:func:`error_type`)."""

    status = 500

    @property
    def type(self) -> str:
        return error_type(self.status)

    def __init__(self, message: str, *, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers or {}


class BadRequest(RouterError):
    """The request body or headers are invalid (400); ``param`` names the field."""

    status = 400


class Unauthorized(RouterError):
    """Missing or wrong credentials (401)."""

    status = 401


class PayloadTooLarge(RouterError):
    """The request body is over ``router.max_body_bytes`` (413)."""

    status = 413


class UnsupportedMediaType(RouterError):
    """The body is sent in a form the router does not read, such as a ``Content-Encoding`` it
    cannot decode (415)."""

    status = 415


class RequestTimeout(RouterError):
    """The client sent its body too slowly (408, past ``router.body_timeout_s``)."""

    status = 408


class NoReplica(RouterError):
    """No healthy replica can take the request (503)."""

    status = 503


class Overloaded(RouterError):
    """Admission refused the request (429); carries Retry-After."""

    status = 429


class UpstreamError(RouterError):
    """A replica failed and the request could not safely be retried (502)."""

    status = 502


REPLICA_PARAMS = {"input_tokens": {"completions": "prompt", "chat": "messages", "score": "context"},
                  "input_text": {"completions": "prompt", "chat": "messages", "score": "context"}}
"""vLLM's names for fields (``error.param`` in its 4xx answers) -> this router's request fields."""
_LOCATIONS = ("body", "query", "path", "header", "cookie")
"""FastAPI's request locations: the first part of a pydantic error location vLLM joins with dots
into ``param`` (``("body", "messages", 0, "content")`` -> ``"body.messages.0.content"``)."""

REQUEST_FIELDS = frozenset("""
    prompt messages model max_tokens max_completion_tokens n stream stream_options temperature top_p top_k
    min_p seed stop stop_token_ids presence_penalty frequency_penalty repetition_penalty logprobs
    top_logprobs prompt_logprobs logit_bias min_tokens ignore_eos echo suffix user best_of response_format
    structured_outputs tool_choice tools add_generation_prompt continue_final_message add_special_tokens
    chat_template_kwargs documents reasoning_effort skip_special_tokens spaces_between_special_tokens
    include_stop_str_in_output allowed_token_ids bad_words vllm_xargs cache_salt priority length_penalty
    return_tokens_as_token_ids return_token_ids logits_processors kv_transfer_params parallel_tool_calls
    """.split())
"""OpenAI/vLLM request fields a replica's error message may name when its ``param`` is null."""
_INDEX = re.compile(r"\.([0-9]+)(?=\.|$)")
"""A list index in a dotted pydantic location (``messages.0.content``)."""
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_OUT_OF_VOCABULARY = re.compile(r"\bToken id -?\d+ is out of vocabulary")
"""vLLM 0.32's refusal of a prompt token ID, sent with a null ``param`` (``renderers/base.py``
``validate_token_ids``, called without one by ``v1/engine/input_processor.py``): it is about
the input tokens. A router without a tokenizer relies on it (``router.tokenize``)."""


def router_param(param: object, endpoint: str) -> object:
    """The field of *our* request that a replica's ``error.param`` refers to, for ``endpoint``
    (``"completions"``, ``"chat"``, ``"score"``): a location prefix is dropped (``"body.seed"`` ->
    ``"seed"``) and list indexes are written as the router's own errors write them
    (``"body.messages.0.content"`` -> ``"messages[0].content"``, ``router.schemas.error_param``),
    vLLM's own names are translated (``input_tokens`` -> ``prompt``); other names pass through."""
    if not isinstance(param, str):
        return param
    location, dot, field = param.partition(".")
    if dot and field and location in _LOCATIONS:
        param = field
    param = _INDEX.sub(r"[\1]", param)
    return REPLICA_PARAMS.get(param, {}).get(endpoint, param)


def param_in_message(message: object) -> str | None:
    """The first request field a replica's error message names (``"temperature must be ..."``), or
    vLLM's own name for it (``input_tokens`` for an out-of-vocabulary token ID)."""
    if not isinstance(message, str):
        return None
    if _OUT_OF_VOCABULARY.search(message[:500]):
        return "input_tokens"
    return next((w for w in _WORD.findall(message[:500]) if w in REQUEST_FIELDS), None)


MAIN_FIELD = {"completions": "prompt", "chat": "messages", "score": "context"}
"""The field a replica's error about an unnamed part of the input is put on, per endpoint."""
_OWN_FIELDS = REQUEST_FIELDS | {"context", "responses", "body"}


_VALIDATION_DUMP = re.compile(r"\d+ validation errors?:\s*\n")
_DUMP_MAX_CHARS = 20_000
"""A longer dump (a huge input quoted in it) is relayed as it is: not parsed."""


def readable_validation(message: object, endpoint: str) -> object:
    """vLLM's FastAPI validation error (``"1 validation error:\n  {'type': ..., 'loc': 'body.seed',
    'msg': ..., 'input': 'x'}"``: pydantic's error dicts printed one per line) as one clause per
    error naming our field, ``"seed: Input should be a valid integer, ... (got 'x')"`` (input and
    location cut by :func:`echo`, the message at twice that); any other message, or a dump that
    does not read as one, unchanged."""
    if not isinstance(message, str) or len(message) > _DUMP_MAX_CHARS or not _VALIDATION_DUMP.match(message):
        return message
    clauses = []
    for line in message.splitlines()[1:]:
        line = line.strip()
        if not line:
            continue
        try:
            item = ast.literal_eval(line)  # literals only; bounded by _DUMP_MAX_CHARS
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return message
        if not isinstance(item, dict) or not isinstance(item.get("msg"), str):
            return message
        loc = item.get("loc")
        try:  # str() of an int past Python's digit limit raises (a hex literal parses without it)
            loc = ".".join(map(str, loc)) if isinstance(loc, (tuple, list)) else str(loc)
        except ValueError:
            return message
        got = f" (got {echo(item['input'])!r})" if "input" in item and not isinstance(item["input"], (dict, list)) else ""
        # a location holds the client's own keys (a logit_bias key) and a message may quote its
        # input: both cut as input is (an attacker got 15,000 characters of its body back)
        clauses.append(f"{echo(router_param(loc, endpoint) or 'body')}: {echo(item['msg'], 2 * ECHO_CHARS)}{got}")
    return "; ".join(clauses) or message


def with_router_param(payload: dict, endpoint: str, status: int | None = None) -> dict:
    """A replica's JSON error answer with ``error.param`` renamed by :func:`router_param`; a null
    ``param`` becomes the field the message names (else ``"body"``): never null on a 4xx. A name
    that is no field of ours (a pydantic union member's location, e.g. vLLM's
    ``"0.ChatCompletionMessageFunctionToolCallParam"`` for a malformed ``tool_calls``) becomes the
    field the message names, else the endpoint's input field (``messages``). With ``status``, the
    ``type`` and ``code`` are the router's own for it (:func:`error_type`; vLLM writes
    ``"BadRequestError"`` or ``"Bad Request"``), as in every error body the router writes. A
    pydantic dump of a message is made readable (:func:`readable_validation`)."""
    error = payload.get("error")
    if isinstance(error, dict):
        message = error.get("message")
        param = router_param(error.get("param") or param_in_message(message) or "body", endpoint)
        if isinstance(param, str) and re.split(r"[.\[]", param, maxsplit=1)[0] not in _OWN_FIELDS:
            param = router_param(param_in_message(message) or MAIN_FIELD.get(endpoint, "body"), endpoint)
        if param == "logprobs" and endpoint == "chat" and isinstance(message, str) and "sample logprobs" in message[:200]:
            param = "top_logprobs"  # vLLM checks a chat's top_logprobs as its SamplingParams.logprobs
        error = {**error, "param": param, "message": readable_validation(message, endpoint)}
        if status is not None:
            error.update(type=error_type(status), code=status)
        payload = {**payload, "error": error}
    return payload


def error_response(status: int, message: str, *, param: str | None = None,
                   headers: dict[str, str] | None = None) -> web.Response:
    """:func:`error_body` as a JSON response."""
    return web.Response(status=status, text=json.dumps(error_body(status, message, param=param)),
                        content_type="application/json", headers=headers)


@web.middleware
async def error_middleware(request: web.Request, handler):
    """Convert RouterError (and aiohttp's own HTTP errors) to JSON; the only such place."""
    try:
        return await handler(request)
    except RouterError as exc:
        if exc.status >= 500:
            log.warning("%s %s -> %d: %s", request.method, request.path, exc.status, exc.message)
        resp = error_response(exc.status, exc.message, param=exc.param, headers=exc.headers)
        if exc.status == 408:  # the rest of a late body may still come: it must not read as a next request
            resp.force_close()
        return resp
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(exc.status, exc.reason, headers=None)
    except Exception:  # the last line: a bug, never a bare page (asyncio.CancelledError passes)
        error_id = uuid.uuid4().hex[:12]
        log.exception("unexpected error %s on %s %s", error_id, request.method, request.path)
        return error_response(500, f"internal error {error_id}: the router logged it; please report it")
