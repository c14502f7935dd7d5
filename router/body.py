"""A request body as JSON: decoded, and checked to be safe to hand to anything else.

Everything a hostile client can put in JSON that would make the router's own code fail is a
400 here, naming the field: invalid JSON or UTF-8, a non-object, ``NaN``/``Infinity`` (not JSON;
vLLM refuses them) and numbers past a float's range (``1e400``, which ``json`` reads as
``inf``), an integer past Python's 4,300-digit limit ("integer too large", naming its field),
nesting deeper than :data:`MAX_JSON_DEPTH` (``json.loads`` hits ``RecursionError`` near 1,000
levels and re-encoding the body for the replica near the same depth), and strings holding a lone UTF-16
surrogate such as ``"\\ud800"`` (valid JSON, but no tokenizer or UTF-8 encoder accepts it).
An integer outside the signed 64-bit range anywhere in the body is a 400 naming its field too:
no engine field takes one, and vLLM answers some with HTTP 500 (``top_k`` of 10**30), which the
router would have retried on every replica.

Bodies are decoded by ``msgspec`` (about 3x faster than ``json`` on a token-ID prompt); whatever
it refuses (``NaN``, a UTF-8 BOM, an out-of-range number, too deep, a lone surrogate, malformed
JSON) is decoded again by ``json``, whose verdict and message stand. Where msgspec accepts a
body, ``json.loads`` gives the same object.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import msgspec

from router.errors import BadRequest, echo
from router.token_ids import int_bounds, split_ids

MAX_JSON_DEPTH = 32
"""Deepest nesting of objects and lists a body may have (an OpenAI chat body needs about 6)."""
_CONTAINERS = (dict, list)


def _refuse_constant(name: str) -> Any:
    raise BadRequest(f"request body holds {name}, which is not JSON; send a number", param="body")


def _finite_float(text: str) -> float:
    """A JSON number past a float's range (``1e400``) is refused as ``NaN`` is: the router never
    holds a non-finite float, so any JSON encoder writes the body back the same."""
    value = float(text)
    if not math.isfinite(value):
        raise BadRequest(f"request body holds the number {echo(text)}, past a float's range; send a smaller one",
                         param="body")
    return value


class _HugeInt:
    """Holds the place of an integer past Python's digit limit (``sys.get_int_max_str_digits()``,
    4,300) while a body is decoded, so :func:`check_tree` can name its field."""

    __slots__ = ("digits",)

    def __init__(self, digits: int) -> None:
        self.digits = digits


def load_json_object(raw: bytes, ids_field: str | None = None) -> dict[str, Any]:
    """Decode a JSON object body; BadRequest (``param`` names the body or the field) otherwise.

    ``ids_field``: a top-level field that usually holds thousands of token IDs (a completion's
    ``prompt``). When it does, it is read straight from ``raw`` as ``router.token_ids.TokenIds``
    (``split_ids``, in C) and only the rest of the body is decoded and checked here: the same
    body, with that field a ``TokenIds`` instead of a list (a 4,000-token prompt: about 170 µs
    of decoding less, and no re-encoding on the way out). Anything else decodes whole."""
    return load_json_split(raw, ids_field)[0]


def load_json_split(raw: bytes, ids_field: str | None = None) -> tuple[dict[str, Any], bytes | None]:
    """:func:`load_json_object`, and the bytes the body was decoded from but for ``ids_field``
    when that field was read straight from ``raw`` (else None): the body is a pure function of
    them (``router.schemas.validate_body`` remembers those that passed)."""
    split = split_ids(raw, ids_field) if ids_field is not None else None
    if split is not None:
        rest, ids, _ = split
        try:
            body = _FAST.decode(rest)
        except (msgspec.DecodeError, RecursionError):
            body = None  # decoded whole below: its verdict and message are about ``raw``
        if isinstance(body, dict):
            if _may_be_unsafe(rest):
                check_tree(body)
            if _LONG_DIGITS.search(rest) is not None:  # else every integer in it has at most 18 digits
                check_int64(body)
            body[ids_field] = ids
            return body, rest
    body, huge = _decode(raw)
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", param="body")
    if huge or _may_be_unsafe(raw):
        check_tree(body)
    check_int64(body)
    return body, None


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_LONG_DIGITS = re.compile(rb"[0-9]{19}")
"""19 digits in a row: the bytes may hold an integer outside int64 (``10**18 < 2**63``), which
:func:`check_int64` then judges; a body without such a run holds none (the split prompt's IDs
are bounded by ``split_ids`` itself)."""


def check_int64(body: Any) -> None:
    """BadRequest naming the first field holding an integer outside ``[-2**63, 2**63)`` (an int
    in a list names the list, as a bad token ID names ``prompt``). A list of plain ints (a
    prompt's thousands of token IDs) is bounded in one C pass (``router.token_ids``), not walked."""
    stack: list[tuple[Any, str]] = [(body, "")]
    while stack:
        value, path = stack.pop()
        if type(value) is int:
            if not INT64_MIN <= value <= INT64_MAX:
                raise BadRequest(f"'{path or 'body'}' holds {echo(value)}, outside the signed 64-bit range; "
                                 "no engine field takes such a number", param=path or "body")
        elif isinstance(value, list):
            bounds = int_bounds(value)
            if bounds is not None and INT64_MIN <= bounds[0] and bounds[1] <= INT64_MAX:
                continue
            stack.extend((item, path if type(item) is int else f"{path}[{i}]") for i, item in enumerate(value)
                         if isinstance(item, (int, list, dict)))
        elif isinstance(value, dict):
            stack.extend((item, f"{path}.{key}" if path else str(key)) for key, item in value.items()
                         if isinstance(item, (int, list, dict)))


_FAST = msgspec.json.Decoder()


def _decode(raw: bytes) -> tuple[Any, bool]:
    """``raw`` decoded: by msgspec, else by ``json`` (BadRequest with its message when it refuses),
    and whether it holds an integer too large to hold (a :class:`_HugeInt` in its place)."""
    try:
        return _FAST.decode(raw), False
    except (msgspec.DecodeError, RecursionError):
        pass
    huge = []

    def parse_int(text: str) -> int | _HugeInt:
        try:
            return int(text)
        except ValueError:  # past the digit limit
            huge.append(_HugeInt(len(text.lstrip("-"))))
            return huge[-1]

    try:
        body = json.loads(raw or b"null", parse_constant=_refuse_constant, parse_float=_finite_float,
                          parse_int=parse_int)
    except RecursionError:
        raise BadRequest(f"request body nests deeper than {MAX_JSON_DEPTH} levels", param="body") from None
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError
        raise BadRequest(f"request body is not valid JSON: {exc}", param="body") from None
    return body, bool(huge)


def _may_be_unsafe(raw: bytes) -> bool:
    """Cheap screen on the raw bytes: could the body nest too deep or hold an escaped surrogate?
    (``find`` runs at memchr speed; ``count`` and two-byte searches cost tens of microseconds
    on a 4,000-token prompt.)"""
    if _occurs_over(raw, (b"[", b"{"), MAX_JSON_DEPTH):
        return True
    return b"\\" in raw and (b"\\u" in raw or b"\\U" in raw)


def _occurs_over(raw: bytes, chars: tuple[bytes, ...], limit: int) -> bool:
    """Whether ``chars`` occur more than ``limit`` times in ``raw`` together (at most ``limit + 1`` finds)."""
    seen = 0
    for ch in chars:
        at = raw.find(ch)
        while at >= 0:
            seen += 1
            if seen > limit:
                return True
            at = raw.find(ch, at + 1)
    return False


def is_utf8(text: str) -> bool:
    """Whether ``text`` encodes to UTF-8 (holds no lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_tree(body: Any) -> None:
    """BadRequest naming the first field nested deeper than :data:`MAX_JSON_DEPTH`, holding a
    string that is not valid Unicode (a lone surrogate) or an integer too large (a :class:`_HugeInt`).
    Iterative: any depth is safe to walk."""
    stack: list[tuple[Any, str, int]] = [(body, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            if not is_utf8(value):
                raise BadRequest(f"'{path or 'body'}' holds a lone surrogate (not valid Unicode)",
                                 param=path or "body")
            continue
        if isinstance(value, _HugeInt):
            raise BadRequest(f"'{path}' is an integer too large ({value.digits} digits)", param=path)
        if not isinstance(value, _CONTAINERS):
            continue
        if depth >= MAX_JSON_DEPTH:
            raise BadRequest(f"'{path}' nests deeper than {MAX_JSON_DEPTH} levels", param=path or "body")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str) and not is_utf8(key):
                raise BadRequest(f"a key in '{path or 'body'}' holds a lone surrogate", param=path or "body")
            if isinstance(item, (str, dict, list, _HugeInt)):
                child = f"{path}[{key}]" if isinstance(key, int) else (f"{path}.{key}" if path else key)
                stack.append((item, child, depth + 1))
