"""The C extension ``cache_policy._native`` (``cache_policy/_native.c``), or None without it.

It accelerates two pieces of per-token work and is never their only home: the Python code in
``cache_policy.hashing`` and ``router.token_ids`` is the reference, used whenever the extension
is missing or declines an input (it answers None for anything but plain ints in range), and
``tests/cache_policy/test_native.py`` checks both give the same answers on generated inputs.
``scripts/setup.sh`` builds it (``setup.py``, ``build_ext --inplace``).
"""

from __future__ import annotations

from types import ModuleType

NATIVE: ModuleType | None
try:
    from cache_policy import _native as NATIVE  # noqa: N811
except ImportError:  # not built (no compiler): the pure-Python path
    NATIVE = None
