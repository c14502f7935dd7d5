"""cache_policy stays pure: no I/O frameworks, no clock, no global randomness."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import cache_policy

FORBIDDEN = {"aiohttp", "ray", "vllm", "redis", "asyncio", "time", "datetime", "socket", "os"}
SOURCES = sorted(Path(cache_policy.__file__).parent.glob("*.py"))


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_no_forbidden_imports(path: Path) -> None:
    assert not imported_roots(path) & FORBIDDEN


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_no_module_level_randomness(path: Path) -> None:
    text = path.read_text()
    for call in ("random.random(", "random.choice(", "random.randrange(", "random.shuffle("):
        assert call not in text, f"{path.name} uses the global rng: {call}"
