"""Shared pytest fixtures: a fixed random seed, a seeded rng, a fake clock.

Package-specific fixtures live in ``tests/<package>/conftest.py``.
"""

from __future__ import annotations

import random

import pytest

TEST_SEED = 0
"""The one seed tests use unless they sweep seeds on purpose."""


class FakeClock:
    """A clock the test advances by hand; ``now()`` returns float seconds."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> float:
        assert seconds >= 0, "a clock does not run backwards"
        self._now += seconds
        return self._now


@pytest.fixture(autouse=True)
def _fixed_global_seed() -> None:
    """Fix the global ``random`` seed, so code that forgets to inject an rng is repeatable."""
    random.seed(TEST_SEED)


@pytest.fixture
def rng() -> random.Random:
    """A seeded ``random.Random`` to inject into code under test."""
    return random.Random(TEST_SEED)


@pytest.fixture
def fake_clock() -> FakeClock:
    """A hand-advanced clock starting at t = 1000.0 s."""
    return FakeClock()
