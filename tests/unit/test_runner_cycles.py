"""No import circles among runner/'s modules, type-level ones (under TYPE_CHECKING, or inside a
function) included: each module of the runner is understood from those below it."""

from __future__ import annotations

import ast
from pathlib import Path

import omlx_logprobs

RUNNER = Path(omlx_logprobs.__file__).parent / "runner"
PACKAGE = "omlx_logprobs.runner"


def _name(path: Path) -> str:
    rel = path.relative_to(RUNNER).with_suffix("")
    return ".".join((PACKAGE, *rel.parts)).removesuffix(".__init__")


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The runner modules `path` imports anywhere in it (`from runner import x` names x)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: a relative import"
            base = node.module or ""
            found |= {f"{base}.{a.name}" for a in node.names} | {base}
    return {m for m in found if m in modules and m != _name(path)}


def graph() -> dict[str, set[str]]:
    files = {_name(p): p for p in RUNNER.rglob("*.py")}
    return {name: _imports(path, set(files)) for name, path in files.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every import path that comes back to where it started (one per circle's first node)."""
    found: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(edges.get(node, ())):
            if nxt == path[0]:
                found.append([*path, nxt])
            elif nxt not in path and nxt > path[0]:  # each circle once, from its least module
                visit(nxt, [*path, nxt])

    for start in sorted(edges):
        visit(start, [start])
    return found


def test_finds_a_circle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


def test_runner_has_no_import_circles() -> None:
    edges = graph()
    assert f"{PACKAGE}.model_runner" in edges and edges[f"{PACKAGE}.model_runner"]
    assert cycles(edges) == []
