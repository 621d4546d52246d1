"""The package's layering: a package imports only packages below it (and the root modules), so
no two packages import each other. The order is the one docs/specs/architecture.md gives."""

from __future__ import annotations

import ast
from pathlib import Path

import omlx_logprobs

ROOT = Path(omlx_logprobs.__file__).parent
# Lowest first. Root modules (types, config, vocab, heap, blas) are level 0; cli.py is on top,
# over options.py (its flags).
TOP = ("options", "cli")
LAYERS = ["", "parsing", "logprobs", "output", "models", "engine", "api", *TOP]


def layer(module: str) -> str:
    """The layer of a dotted module name inside the package ("" for root modules)."""
    parts = module.split(".")[1:]  # drop "omlx_logprobs"
    if parts and (parts[0] in TOP or (ROOT / parts[0]).is_dir()):
        return parts[0]
    return ""


def imports(path: Path) -> set[str]:
    """Every omlx_logprobs module the file imports, at any depth (lazy imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("omlx_logprobs"):
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("omlx_logprobs"))
    return found


def test_every_import_points_down() -> None:
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        name = ".".join(("omlx_logprobs", *path.relative_to(ROOT).with_suffix("").parts))
        name = name.removesuffix(".__init__")
        own = layer(name)
        for target in imports(path):
            if (t := layer(target)) != own and LAYERS.index(t) >= LAYERS.index(own):
                wrong.append(f"{name} ({own or 'root'}) imports {target} ({t or 'root'})")
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_a_wrong_import() -> None:
    assert layer("omlx_logprobs.engine.sequence") == "engine"
    assert layer("omlx_logprobs.types") == "" and layer("omlx_logprobs.cli") == "cli"
    assert LAYERS.index(layer("omlx_logprobs.options")) < LAYERS.index("cli")
    assert LAYERS.index(layer("omlx_logprobs.api.app")) > LAYERS.index("engine")
