"""Console width for the benches' wide tables."""

from __future__ import annotations

import os


def wide_console_width(default: int) -> int:
    """``COLUMNS`` when set (a positive integer), else ``default``: a wide table is printed whole
    to a log or a narrow terminal instead of rich's 80 columns (or a fixed width that ``COLUMNS``
    could not raise: a new user saw `bench.sim`'s 17 columns cut at 200)."""
    value = os.environ.get("COLUMNS", "")
    return int(value) if value.isdigit() and int(value) > 0 else default
