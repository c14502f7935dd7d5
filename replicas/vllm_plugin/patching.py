"""Wrap one attribute of a vLLM class or module, at most once per process.

Every patch the plugin makes goes through :func:`wrap`, which marks the wrapper with the
original it replaced; wrapping an already-wrapped attribute is a no-op, so ``register()`` may
run any number of times (vLLM loads general plugins in the API server, the engine core and
every worker, sometimes twice in one process).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

ORIGINAL_ATTR = "__rollout_router_original__"
_applied: list[tuple[Any, str, Any]] = []
"""(owner, name, attribute before the patch; None = absent), in patch order."""


def is_wrapped(owner: Any, name: str) -> bool:
    """Whether ``owner.name`` (as defined on ``owner`` itself) is one of our wrappers."""
    return hasattr(_unbind(vars(owner).get(name)), ORIGINAL_ATTR)


def wrap(owner: Any, name: str, make_wrapper: Callable[[Callable], Callable]) -> bool:
    """Replace ``owner.name`` with ``make_wrapper(original)``; False if already wrapped.

    ``owner`` is a class or a module and must define ``name`` itself (not inherit it), so the
    patch lands where vLLM looks it up. Classmethods and staticmethods keep their kind.
    """
    current = vars(owner)[name]
    if hasattr(_unbind(current), ORIGINAL_ATTR):
        return False
    func = _unbind(current)
    wrapper = functools.wraps(func)(make_wrapper(func))
    setattr(wrapper, ORIGINAL_ATTR, func)
    if isinstance(current, classmethod):
        wrapper = classmethod(wrapper)
    elif isinstance(current, staticmethod):
        wrapper = staticmethod(wrapper)
    _applied.append((owner, name, current))
    setattr(owner, name, wrapper)
    return True


def add_method(owner: type, name: str, func: Callable) -> bool:
    """Add a new method ``name`` to ``owner``; False if it is already there (ours)."""
    if name in vars(owner):
        return False
    setattr(func, ORIGINAL_ATTR, None)
    _applied.append((owner, name, None))
    setattr(owner, name, func)
    return True


def checkpoint() -> int:
    """A mark for :func:`restore_since`: the number of patches made so far."""
    return len(_applied)


def restore_since(mark: int) -> None:
    """Undo the patches made after ``mark``, newest first (used if installing fails midway)."""
    while len(_applied) > mark:
        owner, name, previous = _applied.pop()
        if previous is None:
            delattr(owner, name)
        else:
            setattr(owner, name, previous)


def _unbind(attr: Any) -> Any:
    return attr.__func__ if isinstance(attr, (classmethod, staticmethod)) else attr
