"""Token-ID lists checked at C speed: thousands of IDs per request are never walked in Python.

Each helper answers exactly what a Python loop over the list would; it only finds the answer
faster on the common case (every ID a plain ``int`` in 64 bits: ``cache_policy.native``'s one
pass, else msgspec and numpy) and falls back to the loop otherwise.
"""

from __future__ import annotations

import sys
from array import array
from typing import Any, NamedTuple

import msgspec
import numpy as np

from cache_policy.native import NATIVE

_INT_LIST = list[int]
_U32 = next(code for code in "IL" if array(code).itemsize == 4)
"""The ``array`` type code of a native 4-byte unsigned integer."""


class TokenIds(array):
    """A token-ID list read straight from a request's JSON (:func:`split_ids`): the IDs packed as
    uint32 (an ``array``, so a ``Sequence[int]`` that ``len``, indexing and the prompt's block
    hashes take as they are, ``cache_policy.hashing`` hashing its buffer in C), its bounds
    (``bounds``: ``(min, max)``) and the JSON text it came from (``json``), which is what the
    router forwards (``router.proxy.encode_body``): the engine sees exactly the IDs hashed.
    Compares equal to a list of the same ints."""

    json: bytes
    bounds: tuple[int, int]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, list):
            return len(self) == len(other) and self.tolist() == other
        return super().__eq__(other)

    __hash__ = None  # type: ignore[assignment]  # mutable, as a list


_SPLIT_OK = NATIVE is not None and sys.byteorder == "little"


class SplitBody(NamedTuple):
    """A JSON object's bytes read by :func:`split_ids`."""

    rest: bytes
    """The object without the member: undecoded (its decoder says whether it is valid JSON)."""
    ids: TokenIds
    """The member's value."""
    streams: bool
    """Whether the object has a top-level ``"stream"`` member (the fast lane hands such a request
    to aiohttp, ``router.fastlane``; the key is unescaped, as every key of a split body is)."""


_last: tuple[bytes, str, SplitBody | None] | None = None
"""The last answer of :func:`split_ids`: the fast lane splits a body to screen it, and the
completions handler then asks again for the same bytes."""


def split_ids(raw: bytes, key: str) -> SplitBody | None:
    """``raw`` (a JSON object's bytes) without its top-level member ``key``, and that member's
    value as :class:`TokenIds`, when the value is a non-empty list of plain JSON integers in
    ``[0, 2**32)`` (``cache_policy.native`` ``split_ids``: one C pass, no Python int per ID).
    None whenever that is not certain (another value, a negative or fractional ID, the key twice
    or escaped, no extension): the caller decodes ``raw`` whole, which gives the same body. The
    last answer is kept and given again for equal bytes (the lane's body, handed to aiohttp, comes
    back to the handler as another bytes object with the same content)."""
    global _last
    if not _SPLIT_OK:
        return None
    last = _last
    if last is not None and last[1] == key and (last[0] is raw or last[0] == raw):  # == : a memcmp, not a split
        return last[2]
    found = NATIVE.split_ids(raw, key.encode(), b"stream")
    split = None
    if found is not None:
        cut_start, cut_end, packed, lo, hi, value_start, value_end, streams = found
        ids = TokenIds(_U32)
        ids.frombytes(packed)
        ids.json, ids.bounds = raw[value_start:value_end], (lo, hi)
        split = SplitBody(raw[:cut_start] + raw[cut_end:], ids, streams)
    _last = (raw, key, split)
    return split


def int_bounds(value: list[Any]) -> tuple[int, int] | None:
    """``(min(value), max(value))`` when ``value`` is non-empty and every item is exactly an
    ``int``; None otherwise (one C pass with ``cache_policy.native``; a :class:`TokenIds` knows
    its own)."""
    if type(value) is TokenIds:
        return value.bounds
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
