"""One-line configuration errors: ``<owner>.<field path>: <what is wrong>, got <value>``.

Every config section (``PolicyConfig``, ``ReplicaSetConfig``, the router's) is a pydantic
dataclass. pydantic reports a wrong type as a multi-line ``ValidationError``; the sections
run :func:`validate_one_line` as a wrap validator, so any mistake (wrong type, unknown key,
a value the section's ``__post_init__`` refuses) reads as one line naming the field, for
example ``ReplicaSetConfig.kv_cache_space_gib: must be a whole number of GiB, got 1.5``.
``router.config`` swaps the owner for the YAML section (``replicas.kv_cache_space_gib``).

Every section is built with :data:`SECTION_CONFIG`: strict types (a YAML ``true`` or ``'64'`` is
no integer, a string is no number; an integer is still a number) and finite numbers only (a
``.inf`` timeout would let a request wait forever).
"""

from __future__ import annotations

import re
from typing import Any, Callable

from pydantic import ConfigDict, ValidationError

SECTION_CONFIG = ConfigDict(extra="forbid", use_attribute_docstrings=True, strict=True, allow_inf_nan=False)
"""The pydantic config of every config section: unknown keys, bools or strings where numbers are
meant, whole-number floats where integers are meant, lists where tuples are meant (convert YAML
lists first, as ``from_dict`` / ``from_mapping`` do) and inf/nan are refused."""

_PHRASES = {
    "int_from_float": "must be a whole number",
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "finite_number": "must be a finite number",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "string_type": "must be a string",
    "tuple_type": "must be a list",
    "list_type": "must be a list",
    "dict_type": "must be a mapping",
    "unexpected_keyword_argument": "is not a known key",
}


def field_path(loc: tuple[Any, ...]) -> str:
    """``("extra_env", "X")`` -> ``"extra_env.X"``; ``("urls", 0)`` -> ``"urls[0]"``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def describe(error: dict[str, Any], owner: str) -> str:
    """One pydantic error (an item of ``ValidationError.errors()``) as ``owner.path: reason``."""
    path = field_path(tuple(error.get("loc", ())))
    if error["type"] == "value_error":
        message = str(error.get("ctx", {}).get("error", error["msg"]))
        named = re.match(rf"^{re.escape(owner)}\.(\S+?):? (.*)$", message, re.S)
        if named:
            return f"{owner}.{named.group(1)}: {named.group(2)}"
        return f"{owner}.{path}: {message}" if path else f"{owner}: {message}"
    if error["type"] == "literal_error":
        reason = f"must be one of {error.get('ctx', {}).get('expected', '')}"
    else:
        reason = _PHRASES.get(error["type"]) or (error["msg"][:1].lower() + error["msg"][1:])
    if error["type"] != "unexpected_keyword_argument":
        reason += f", got {error.get('input')!r}"
    return f"{owner}.{path}: {reason}"


def validate_one_line(owner: str, data: Any, handler: Callable[[Any], Any]) -> Any:
    """Run pydantic's ``handler``; turn its ``ValidationError`` into a one-line ``ValueError``.

    Meant for ``@model_validator(mode="wrap")``; pydantic re-wraps the ``ValueError``, so callers
    still catch ``ValueError`` (``ValidationError`` is one) and read :func:`one_line`.
    """
    try:
        return handler(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise ValueError(describe(errors[0], owner) + more) from None


def one_line(exc: ValueError) -> str:
    """The one-line message of a config error, whether pydantic wrapped it or not."""
    if isinstance(exc, ValidationError):
        errors = exc.errors(include_url=False)
        if errors and errors[0]["type"] == "value_error" and not errors[0].get("loc"):
            return str(errors[0].get("ctx", {}).get("error", errors[0]["msg"]))
        return describe(errors[0], exc.title) if errors else str(exc)
    return str(exc)
