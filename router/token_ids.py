"""Token-ID lists checked at C speed: thousands of IDs per request are never walked in Python.

Each helper answers exactly what a Python loop over the list would; it only finds the answer
faster on the common case (every ID a plain ``int`` in 64 bits: ``cache_policy.native``'s one
pass, else msgspec and numpy) and falls back to the loop otherwise.
"""

from __future__ import annotations

from array import array
from typing import Any

import msgspec
import numpy as np

from cache_policy.native import NATIVE

_INT_LIST = list[int]
_U32 = next(code for code in "IL" if array(code).itemsize == 4)
"""The ``array`` type code of a native 4-byte unsigned integer."""


def int_bounds(value: list[Any]) -> tuple[int, int] | None:
    """``(min(value), max(value))`` when ``value`` is non-empty and every item is exactly an
    ``int``; None otherwise (one C pass with ``cache_policy.native``)."""
    if NATIVE is not None:
        bounds = NATIVE.int_bounds(value)
        if bounds is not None:
            return bounds
    return _min_max(value) if value and _all_ints(value) else None


def all_ints(value: list[Any]) -> bool:
    """Whether every item of ``value`` is exactly an ``int`` (``bool`` is not), as
    ``all(type(t) is int for t in value)``; True for an empty list."""
    return not value or int_bounds(value) is not None


def _all_ints(value: list[Any]) -> bool:
    """:func:`all_ints` without the extension (or past its 64 bits)."""
    try:
        msgspec.convert(value, _INT_LIST)  # strict: bools, floats and strings are refused
        return True
    except msgspec.ValidationError:  # or an int past 64 bits, which msgspec does not take
        return all(type(t) is int for t in value)


def as_uint32(ids: list[int]) -> np.ndarray | None:
    """``ids`` (plain ints) as a uint32 array, shape ``(len(ids),)``; None when one is outside
    ``[0, 2**32)`` (negative, or too large for a token ID)."""
    try:
        return np.frombuffer(array(_U32, ids), dtype=np.uint32)
    except OverflowError:
        return None


def min_max(ids: list[int]) -> tuple[int, int]:
    """``(min(ids), max(ids))`` of a non-empty list of plain ints; ValueError when empty."""
    bounds = int_bounds(ids)
    return bounds if bounds is not None else (min(ids), max(ids))


def _min_max(ids: list[int]) -> tuple[int, int]:
    """:func:`min_max` of plain ints without the extension: numpy on their uint32 packing."""
    packed = as_uint32(ids)
    if packed is None or not len(packed):
        return min(ids), max(ids)
    return int(packed.min()), int(packed.max())
