"""Compatibility name: the shared state lives in the ``router.state`` package (issue 13)."""

from router.state import MemoryState, RedisState, make_state

__all__ = ["MemoryState", "RedisState", "make_state"]
