"""A request body as JSON: decoded, and checked to be safe to hand to anything else.

Everything a hostile client can put in JSON that would make the router's own code fail is a
400 here, naming the field: invalid JSON or UTF-8, a non-object, ``NaN``/``Infinity`` (not JSON;
vLLM refuses them), an integer past Python's 4,300-digit limit, nesting deeper than
:data:`MAX_JSON_DEPTH` (``json.loads`` hits ``RecursionError`` near 1,000 levels and
re-encoding the body for the replica near the same depth), and strings holding a lone UTF-16
surrogate such as ``"\\ud800"`` (valid JSON, but no tokenizer or UTF-8 encoder accepts it).
"""

from __future__ import annotations

import json
from typing import Any

from router.errors import BadRequest

MAX_JSON_DEPTH = 32
"""Deepest nesting of objects and lists a body may have (an OpenAI chat body needs about 6)."""
_CONTAINERS = (dict, list)


def _refuse_constant(name: str) -> Any:
    raise BadRequest(f"request body holds {name}, which is not JSON; send a number", param="body")


def load_json_object(raw: bytes) -> dict[str, Any]:
    """Decode a JSON object body; BadRequest (``param`` names the body or the field) otherwise."""
    try:
        body = json.loads(raw or b"null", parse_constant=_refuse_constant)
    except RecursionError:
        raise BadRequest(f"request body nests deeper than {MAX_JSON_DEPTH} levels", param="body") from None
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError, or an over-long integer
        raise BadRequest(f"request body is not valid JSON: {exc}", param="body") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", param="body")
    if _may_be_unsafe(raw):
        check_tree(body)
    return body


def _may_be_unsafe(raw: bytes) -> bool:
    """Cheap screen on the raw bytes: could the body nest too deep or hold an escaped surrogate?"""
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH:
        return True
    return b"\\u" in raw or b"\\U" in raw


def is_utf8(text: str) -> bool:
    """Whether ``text`` encodes to UTF-8 (holds no lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_tree(body: Any) -> None:
    """BadRequest naming the first field nested deeper than :data:`MAX_JSON_DEPTH` or holding a
    string that is not valid Unicode (a lone surrogate). Iterative: any depth is safe to walk."""
    stack: list[tuple[Any, str, int]] = [(body, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            if not is_utf8(value):
                raise BadRequest(f"'{path or 'body'}' holds a lone surrogate (not valid Unicode)",
                                 param=path or "body")
            continue
        if not isinstance(value, _CONTAINERS):
            continue
        if depth >= MAX_JSON_DEPTH:
            raise BadRequest(f"'{path}' nests deeper than {MAX_JSON_DEPTH} levels", param=path or "body")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str) and not is_utf8(key):
                raise BadRequest(f"a key in '{path or 'body'}' holds a lone surrogate", param=path or "body")
            if isinstance(item, (str, dict, list)):
                child = f"{path}[{key}]" if isinstance(key, int) else (f"{path}.{key}" if path else key)
                stack.append((item, child, depth + 1))
