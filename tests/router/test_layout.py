"""The layout holds: no import cycles in ``router/`` or ``cache_policy/`` (every import counts,
``TYPE_CHECKING`` and function-level ones too), nothing in ``router/`` imports ``bench/``, and the
router's serve path loads none of torch, vLLM, transformers, Ray or the replicas' actor code."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("router", "cache_policy")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, name: str) -> set[str]:
    """Every module ``path`` (module ``name``) names in an import, and every ``module.attr`` it
    imports from one (so ``from router import keys`` yields ``router.keys``); relative ones resolved."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            found |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return found


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Module -> the modules of ``packages`` under ``root`` it imports."""
    files = {module_name(p, root): p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))}
    return {name: {m for m in imports_of(path, name) if m in files and m != name} for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_type_checking_cycle(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n")
    (pkg / "c.py").write_text("def f():\n    import pkg.a\n")
    assert cycles(import_graph(tmp_path, ("pkg",))) == [["pkg.a", "pkg.b"]]


def test_no_import_cycles_in_router_and_cache_policy():
    assert cycles(import_graph(REPO, PACKAGES)) == []


def test_router_never_imports_bench():
    offenders = {name: sorted(m for m in imports_of(path, name) if m.split(".")[0] == "bench")
                 for path in (REPO / "router").rglob("*.py") for name in [module_name(path, REPO)]}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_serve_path_loads_no_engine_code():
    code = ("import sys, router.cli, router.server, router.app, replicas.replica_set\n"
            "heavy = ('torch', 'vllm', 'transformers', 'ray', 'replicas.actor', 'replicas.tiny_model')\n"
            "print(sorted(m for m in sys.modules if m in heavy or m.startswith(tuple(h + '.' for h in heavy))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
