"""argparse types shared by the benchmarks' command lines: a bad value is a usage error naming it."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``low`` (``ArgumentTypeError`` naming the value otherwise)."""
    what = "a positive integer" if low == 1 else f"an integer >= {low}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
        return value

    return parse


def non_negative(text: str) -> float:
    """An argparse type: a number >= 0 (``ArgumentTypeError`` naming the value otherwise)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value
