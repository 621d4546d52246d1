"""The package's layering: a package imports only packages below it (and the root modules), so
no two packages import each other; no module imports itself through others. The order is the
one docs/specs/architecture.md gives. Inside api/ the shared core is below the API packages,
which import no other API package; inside runner/ each module sits on a floor of its own
(`RUNNER_FLOORS`), the circles still to be cut named in `RUNNER_CIRCLES`. A relative import is
resolved like an absolute one, and one that names no module of the package is refused."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import omlx_logprobs

ROOT = Path(omlx_logprobs.__file__).parent
# Lowest first. Root modules (types, control, config, vocab, heap, blas) are level 0; cli.py is on
# top, over options.py (its flags) and serve_config.py (the config they make). The engine's wing
# is six floors: batch/ (plain Python), runner/ (all MLX, its fast paths in runner/fast/),
# training/ (LoRA runs trained on the runner's model, between the engine's steps), engine/ (the
# step loop), distributed/ (a model over several processes), transport/ (the engine
# in this process or a child, as the API sees it). batchdir/ (the Batch API's folder on disk) is
# plain Python below api/, which reaches the disk only through it.
TOP = ("options", "serve_config", "cli")
LAYERS = [
    "",
    "parsing",
    "logprobs",
    "output",
    "models",
    "batch",
    "runner",
    "training",
    "engine",
    "distributed",
    "transport",
    "batchdir",
    "api",
    *TOP,
]

# Inside api/, lowest first: the shared core (the one request path, the pool of models, the
# errors and framing every API uses), then the API packages side by side (each its routes and
# each request's `Run`; none imports another), then the modules that put them together into
# the app (app.py, the guard in front of it, the uvicorn server).
API_CORE = "core"
API_PACKAGES = (
    "openai", "responses", "anthropic", "ollama", "rl", "tinker", "admin", "metrics", "scoring",
    "batches",
)  # fmt: skip
API_APP = ("app", "guard", "server")
# Inside runner/, lowest first (names under runner/; "__init__" is the package itself): a module
# imports only modules on floors below its own, type-level imports included.
RUNNER_FLOORS = [
    "__init__ fixed_rows",  # the package; batch-invariant mode's products
    # nothing of runner/ but those: the batch's caches, the head, sampling, grammars,
    # adapters, new weights, drafts from text, scored prompts, embedding prompts' hidden states,
    # an encoder model's forward, prefill attention, routed experts and two kernels of fast/
    "fast batch_cache drafts encoder grammar head lora pooling prompt_scoring"
    " query_blocks routing sampler weights fast.attention fast.fusion",
    # a draft model; a kept start; a step's and a verify's records; a prompt's images into its
    # input embeddings (and a Qwen VL row's decode positions moved in the batch's caches)
    "draft_model invariance prefix step verify vision",
    "batch_state disk_tier snapshot",  # the batch's rows; kept starts on disk, in and out of caches
    "masks prefix_cache probe",
    "fast.compiled prompt_cache",
    "fast.lean_decode keep",
    "plan",  # the start-up decisions
    "prefill speculation",
    "model_runner scorer",  # the runner, and the trainer's side of batch-invariant mode
]
# Imports that go up the floors (type-level only): circles still to be cut. An entry goes when
# its import does (the test refuses one that no longer exists); none may be added.
RUNNER_CIRCLES: set[tuple[str, str]] = set()


def layer(module: str) -> str:
    """The layer of a dotted module name inside the package ("" for root modules)."""
    parts = module.split(".")[1:]  # drop "omlx_logprobs"
    if parts and (parts[0] in TOP or (ROOT / parts[0]).is_dir()):
        return parts[0]
    return ""


@cache
def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    return {name_of(path): path for path in sorted(ROOT.rglob("*.py"))}


def name_of(path: Path) -> str:
    """A file's dotted module name (a package's `__init__.py` by the package's name)."""
    name = ".".join(("omlx_logprobs", *path.relative_to(ROOT).with_suffix("").parts))
    return name.removesuffix(".__init__")


def _package_of(path: Path) -> str:
    """The package a file's relative imports start from."""
    name = name_of(path)
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def relative_targets(package: str, node: ast.ImportFrom) -> set[str] | None:
    """What `from .x import y` (any level) in a module of `package` names, absolute: the
    module, and each name as a module of it; None when it climbs above the package or names
    no module of it."""
    base = package.split(".")
    if node.level > len(base):
        return None
    target = ".".join(base[: len(base) - node.level + 1])
    if node.module:
        target += f".{node.module}"
    if target not in modules():
        return None
    return {target} | {f"{target}.{a.name}" for a in node.names}


def _typing_blocks_dropped(tree: ast.Module) -> ast.Module:
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []
    return tree


def imports(path: Path, typing_too: bool = True) -> set[str]:
    """Every omlx_logprobs module the file imports, at any depth (lazy imports and relative
    ones included; those under `if TYPE_CHECKING:` only if typing_too)."""
    tree = ast.parse(path.read_text())
    if not typing_too:
        tree = _typing_blocks_dropped(tree)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            found |= relative_targets(_package_of(path), node) or set()
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("omlx_logprobs"):
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("omlx_logprobs"))
    return found


def unresolved(path: Path) -> list[str]:
    """The file's relative imports that name no module of the package."""
    return [
        f"{name_of(path)}:{node.lineno} {ast.unparse(node)}"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom)
        and node.level > 0
        and relative_targets(_package_of(path), node) is None
    ]


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
    one; and the trainer's scorer (runner/scorer.py), which joins the projections as the server
    does, since a product's bits follow its number of output columns."""
    importers = {
        name
        for name, path in modules().items()
        if not name.startswith("omlx_logprobs.runner.fast")
        and any(t.startswith("omlx_logprobs.runner.fast") for t in imports(path))
    }
    runner = "omlx_logprobs.runner"
    assert importers == {f"{runner}.model_runner", f"{runner}.plan", f"{runner}.scorer"}


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


def test_relative_imports_resolve() -> None:
    """A relative import counts like the absolute one it means; one the check cannot resolve
    to a module of the package is refused, so none slips past the layers."""
    bad = [u for path in modules().values() for u in unresolved(path)]
    assert not bad, "\n".join(bad)


def test_the_check_resolves_relative_imports() -> None:
    def parsed(source: str) -> ast.ImportFrom:
        node = ast.parse(source).body[0]
        assert isinstance(node, ast.ImportFrom)
        return node

    api = "omlx_logprobs.api.openai"
    core = {"omlx_logprobs.api.core", "omlx_logprobs.api.core.sse"}
    assert relative_targets(api, parsed("from ..core import sse")) == core
    assert relative_targets(api, parsed("from . import chat")) == {api, f"{api}.chat"}
    assert relative_targets(api, parsed("from ..nowhere import x")) is None
    assert relative_targets(api, parsed("from .... import x")) is None


def api_floor(module: str) -> tuple[int, str]:
    """A module of api/: its floor (0 the core and the package itself, 1 an API package, 2
    the app's modules) and its package ("" for the app's modules, which are one group)."""
    parts = module.split(".")[2:]  # drop "omlx_logprobs.api"
    if not parts or parts[0] == API_CORE:
        return 0, API_CORE
    return (1, parts[0]) if parts[0] in API_PACKAGES else (2, "")


def test_inside_api_the_core_is_below_the_apis() -> None:
    """The core imports no API package and no API package another: an API reaches another's
    work only through the core."""
    wrong = []
    for name, path in modules().items():
        if layer(name) != "api":
            continue
        floor, own = api_floor(name)
        for target in imports(path):
            if layer(target) == "api" and (t := api_floor(target))[1] != own and t[0] >= floor:
                wrong.append(f"{name} ({own}) imports {target} ({t[1]})")
    assert not wrong, "\n".join(wrong)


def test_every_api_module_has_a_floor() -> None:
    """api/'s own modules are the app's; everything else is in the core or an API package."""
    api = ROOT / "api"
    packages = {p.parent.name for p in api.glob("*/__init__.py")}
    assert packages == {API_CORE, *API_PACKAGES}
    assert {p.stem for p in api.glob("*.py")} == {"__init__", *API_APP}


def runner_name(module: str) -> str:
    """A runner module's name under runner/ ("__init__" for the package itself)."""
    return module.removeprefix("omlx_logprobs.runner").removeprefix(".") or "__init__"


def runner_imports() -> set[tuple[str, str]]:
    """Every import between runner/'s modules (type-level ones too), as (importer, imported)."""
    mods = modules()
    return {
        (runner_name(name), runner_name(target))
        for name, path in mods.items()
        if layer(name) == "runner"
        for target in imports(path)
        if layer(target) == "runner" and target in mods and target != name
    }


def test_inside_runner_every_import_points_down() -> None:
    floor = {m: i for i, names in enumerate(RUNNER_FLOORS) for m in names.split()}
    placed = {runner_name(m) for m in modules() if layer(m) == "runner"}
    assert placed == set(floor), f"place on a floor: {sorted(placed - set(floor))}"
    edges = runner_imports()
    up = {(a, b) for a, b in edges if floor[b] >= floor[a]}
    assert up <= RUNNER_CIRCLES, f"imports up the floors: {sorted(up - RUNNER_CIRCLES)}"
    assert RUNNER_CIRCLES <= up, f"cut, out of RUNNER_CIRCLES: {sorted(RUNNER_CIRCLES - up)}"
