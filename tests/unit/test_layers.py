"""The package's layering: a package imports only packages below it (and the root modules), so
no two packages import each other; no module imports itself through others. The order is the
one docs/specs/architecture.md gives."""

from __future__ import annotations

import ast
from pathlib import Path

import omlx_logprobs

ROOT = Path(omlx_logprobs.__file__).parent
# Lowest first. Root modules (types, config, vocab, heap, blas) are level 0; cli.py is on top,
# over options.py (its flags). The engine's wing is five floors: batch/ (plain Python), runner/
# (all MLX, its fast paths in runner/fast/), engine/ (the step loop), distributed/ (a model over
# several processes), transport/ (the engine in this process or a child, as the API sees it).
TOP = ("options", "cli")
LAYERS = [
    "",
    "parsing",
    "logprobs",
    "output",
    "models",
    "batch",
    "runner",
    "engine",
    "distributed",
    "transport",
    "api",
    *TOP,
]


def layer(module: str) -> str:
    """The layer of a dotted module name inside the package ("" for root modules)."""
    parts = module.split(".")[1:]  # drop "omlx_logprobs"
    if parts and (parts[0] in TOP or (ROOT / parts[0]).is_dir()):
        return parts[0]
    return ""


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        name = ".".join(("omlx_logprobs", *path.relative_to(ROOT).with_suffix("").parts))
        found[name.removesuffix(".__init__")] = path
    return found


def imports(path: Path, typing_too: bool = True) -> set[str]:
    """Every omlx_logprobs module the file imports, at any depth (lazy imports included; those
    under `if TYPE_CHECKING:` only if typing_too)."""
    tree = ast.parse(path.read_text())
    if not typing_too:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                node.body = []
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("omlx_logprobs"):
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("omlx_logprobs"))
    return found


def imports_mlx(path: Path) -> bool:
    """Whether the file imports mlx or mlx-lm itself."""
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        if any(n.split(".")[0] in ("mlx", "mlx_lm") for n in names):
            return True
    return False


def test_every_import_points_down() -> None:
    wrong = []
    for name, path in modules().items():
        own = layer(name)
        for target in imports(path):
            if (t := layer(target)) != own and LAYERS.index(t) >= LAYERS.index(own):
                wrong.append(f"{name} ({own or 'root'}) imports {target} ({t or 'root'})")
    assert not wrong, "\n".join(wrong)


def test_no_module_imports_itself_through_others() -> None:
    """No import cycle between modules, lazy imports included (a type checker's are not run)."""
    mods = modules()
    graph = {m: set(mods) & imports(p, typing_too=False) - {m} for m, p in mods.items()}
    done: set[str] = set()

    def cycle_from(m: str, path: list[str]) -> list[str] | None:
        if m in path:
            return path[path.index(m) :] + [m]
        if m in done:
            return None
        for t in sorted(graph[m]):
            if found := cycle_from(t, [*path, m]):
                return found
        done.add(m)
        return None

    for m in sorted(graph):
        found = cycle_from(m, [])
        assert found is None, " -> ".join(found or [])


def test_the_batch_layer_runs_no_mlx() -> None:
    """batch/ and every module it imports, at any depth, are plain Python (numpy at most)."""
    mods = modules()
    seen, todo = set(), [m for m in mods if layer(m) == "batch"]
    while todo:
        if (m := todo.pop()) in seen or m not in mods or m == "omlx_logprobs":
            continue
        seen.add(m)
        assert not imports_mlx(mods[m]), f"{m} imports mlx"
        todo.extend(imports(mods[m]))
    assert "omlx_logprobs.batch.scheduler" in seen and "omlx_logprobs.types" in seen


def test_only_the_model_runner_chooses_the_fast_paths() -> None:
    """runner/fast/ is a set of opt-out speed-ups: the model runner decides which run (with its
    start-up plan, runner/plan.py), so no other module (but the fast paths themselves) imports
    one."""
    importers = {
        name
        for name, path in modules().items()
        if not name.startswith("omlx_logprobs.runner.fast")
        and any(t.startswith("omlx_logprobs.runner.fast") for t in imports(path))
    }
    assert importers == {"omlx_logprobs.runner.model_runner", "omlx_logprobs.runner.plan"}


def test_the_check_sees_a_wrong_import() -> None:
    assert layer("omlx_logprobs.batch.sequence") == "batch"
    assert layer("omlx_logprobs.runner.fast.compiled") == "runner"
    assert layer("omlx_logprobs.types") == "" and layer("omlx_logprobs.cli") == "cli"
    assert LAYERS.index(layer("omlx_logprobs.options")) < LAYERS.index("cli")
    assert LAYERS.index(layer("omlx_logprobs.api.app")) > LAYERS.index("transport")
    wing = ["batch", "runner", "engine", "distributed", "transport"]
    assert [LAYERS.index(p) for p in wing] == sorted(LAYERS.index(p) for p in wing)


def test_every_package_has_a_floor() -> None:
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert packages | set(TOP) == set(LAYERS) - {""}
