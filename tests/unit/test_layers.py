"""The package's layers, from low to high, and the one direction imports go: a module imports only from its own
layer or a lower one, no two modules import each other (directly or round a longer loop), and inside the engine
each part imports only the parts below it. Imports are read from the source (``ast``): top level, inside
functions and under ``TYPE_CHECKING`` alike, ``from detrain... import`` and ``import detrain...`` alike, since
each is a dependency a reader has to follow.

Why the order differs from the plain flow (config -> nn -> ... -> engine):

* ``distributed`` sits just above the ground, below ``config``: it takes plain values (a device string, node
  counts, addresses), never a ``Cfg``, and imports nothing of detrain but ``errors``. ``config`` checks ``nnodes``
  with the launcher's own parser (``launch.checks.parse_nnodes``: one reading of torchrun's syntax), and ``data``
  calls collectives (the first process of a node prepares the files, the ground truth is gathered).
* ``nn`` below ``weights``: a checkpoint is read into a ``DetectionModel``; the model knows nothing of files.
* ``metrics`` below ``data``: the ground truth of a split is read into the metrics' COCO records.
* ``plots`` above ``data`` and ``metrics``: it draws their results; the engine above it calls it.
* The package root (``detrain/__init__.py``) is no layer: it holds ``__version__`` (any module may read it) and
  hands out ``Model`` lazily, so ``import detrain`` stays cheap; nothing imports the root for anything else.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "detrain"

# The layers from low to high; the names of one layer may import each other (but not round a cycle).
LAYERS: list[tuple[str, ...]] = [
    ("errors", "system", "log"),  # the ground: the standard library, torch, numpy, and each other
    ("distributed",),
    ("config",),
    ("nn",),
    ("weights",),
    ("metrics",),
    ("data",),
    ("plots",),
    ("engine",),
    ("run",),
    ("api", "cli"),  # the two front doors
]

# Inside detrain/engine, from low to high. A part imports only itself and the parts of lower rows; the parts of
# one row never import each other (predict is no kind of training, and training is no kind of prediction).
# Evaluation sits above telemetry and below train: training validates, and a validator may record what it did.
ENGINE_LAYERS: list[tuple[str, ...]] = [
    ("run_plan", "build", "export", "script_check"),  # what every worker receives; arguments -> model and run folder;
    # export; what a TorchScript archive's code may do
    ("openvino_ir",),  # OpenVINO IR: written from export's ONNX graph, read back for backends
    ("backends", "tta"),  # exported files served to val and predict (reads what export writes); test-time
    # augmentation of val's and predict's forward
    ("telemetry",),
    ("evaluate",),
    ("train", "predict"),
]

# Import edges (importer, imported) that close a cycle today, each with its reason; the test fails when one of
# them is gone, so that the entry goes too.
KNOWN_CYCLE_EDGES: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Import:
    """One import statement's target as a module of detrain (``target``), where it is written."""

    importer: str
    target: str
    line: int

    def where(self) -> str:
        return f"{self.importer} (line {self.line}) imports {self.target}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES: dict[str, Path] = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def resolve(dotted: str) -> str | None:
    """The detrain module ``dotted`` names, or the longest module it starts with (``detrain.x.Name`` -> x)."""
    parts = dotted.split(".")
    while parts:
        if ".".join(parts) in MODULES:
            return ".".join(parts)
        parts.pop()
    return None


def imports_of(module: str, source: str | None = None) -> list[Import]:
    """Every detrain import in ``module`` (its file, or ``source`` in its place), wherever it is written."""
    path = MODULES[module]
    tree = ast.parse(path.read_text() if source is None else source)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[Import] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = resolve(alias.name) if alias.name.split(".")[0] == "detrain" else None
                if target:
                    found.append(Import(module, target, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package (level 1) or its parents
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source_module = ".".join(base + ([node.module] if node.module else []))
            else:
                source_module = node.module or ""
            if source_module.split(".")[0] != "detrain":
                continue
            for name in (alias.name for alias in node.names):  # from pkg import submodule: that submodule
                target = resolve(f"{source_module}.{name}")
                if target != f"{source_module}.{name}":
                    target = resolve(source_module)
                if target:
                    found.append(Import(module, target, node.lineno))
    return found


def part(module: str) -> str:
    """``detrain.engine.train.trainer`` -> ``engine``; ``detrain.cli`` -> ``cli``; the root -> ``""``."""
    return module.split(".")[1] if "." in module else ""


def engine_part(module: str) -> str:
    """``detrain.engine.train.trainer`` -> ``train``; ``detrain.engine.build`` -> ``build``."""
    return module.split(".")[2] if module.count(".") >= 2 else ""


def rank(table: list[tuple[str, ...]], name: str) -> int:
    return next(i for i, row in enumerate(table) if name in row)


def upward(imports: list[Import]) -> list[str]:
    """The imports that reach a higher layer, or a higher or sibling part of the engine."""
    bad = []
    for imp in imports:
        low, high = part(imp.target), part(imp.importer)
        if not low or not high:  # the root: see test_the_root_is_imported_for_its_version_only
            continue
        if rank(LAYERS, low) > rank(LAYERS, high):
            bad.append(f"{imp.where()}: layer {low!r} is above {high!r}")
        elif low == high == "engine":
            mine, theirs = engine_part(imp.importer), engine_part(imp.target)
            if mine and theirs and mine != theirs and rank(ENGINE_LAYERS, theirs) >= rank(ENGINE_LAYERS, mine):
                bad.append(f"{imp.where()}: engine part {theirs!r} is not below {mine!r}")
    return bad


def graph(sources: dict[str, str] | None = None) -> dict[str, set[str]]:
    """module -> the modules it imports (the root's lazy ``Model`` left out: it is the front door, not a need)."""
    sources = sources or {}
    return {
        m: {imp.target for imp in imports_of(m, sources.get(m)) if imp.target != m} if m != "detrain" else set()
        for m in MODULES
    }


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return groups


def without_known(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    return {m: {t for t in targets if (m, t) not in KNOWN_CYCLE_EDGES} for m, targets in edges.items()}


def test_every_folder_and_top_module_has_a_layer() -> None:
    placed = {name for row in LAYERS for name in row}
    parts = {part(m) for m in MODULES} - {""}
    assert parts <= placed, f"place {sorted(parts - placed)} in LAYERS (tests/unit/test_layers.py)"
    assert placed <= parts, f"LAYERS names what detrain no longer has: {sorted(placed - parts)}"
    engine = {engine_part(m) for m in MODULES if part(m) == "engine"} - {""}
    engine_placed = {name for row in ENGINE_LAYERS for name in row}
    assert engine == engine_placed, f"ENGINE_LAYERS and detrain/engine differ: {sorted(engine ^ engine_placed)}"


def test_no_module_imports_a_higher_layer() -> None:
    bad = [line for m in MODULES for line in upward(imports_of(m))]
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_no_two_modules_import_each_other() -> None:
    edges = graph()
    found = cycles(without_known(edges))
    assert not found, "import cycles: " + "; ".join(" <-> ".join(group) for group in found)
    for (importer, target), reason in KNOWN_CYCLE_EDGES.items():
        assert target in edges.get(importer, set()), f"{importer} -> {target} is gone: drop it ({reason})"
        closed = any({importer, target} <= set(group) for group in cycles(edges))
        assert closed, f"{importer} -> {target} closes no cycle any more: drop it ({reason})"


def test_the_root_is_imported_for_its_version_only() -> None:
    bad = []
    for m in MODULES:
        if m == "detrain":
            continue
        tree = ast.parse(MODULES[m].read_text())
        takes_root = any(
            isinstance(n, ast.Import) and any(a.name == "detrain" for a in n.names) for n in ast.walk(tree)
        )
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "detrain" and not node.level:
                bad += [f"{m} (line {node.lineno}): {a.name}" for a in node.names if a.name != "__version__"]
            if takes_root and isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                dunder = node.attr.startswith("__")  # __version__, __file__: the module's own, not Model
                if node.value.id == "detrain" and not dunder and f"detrain.{node.attr}" not in MODULES:
                    bad.append(f"{m} (line {node.lineno}): detrain.{node.attr}")
    assert not bad, "the package root gives __version__ (and its own dunders) only:\n" + "\n".join(bad)


# ------------------------------------------------------------------ the checks themselves catch what they should


@pytest.mark.parametrize(
    ("module", "added", "expected"),
    [
        ("detrain.nn.boxes", "from detrain.engine.build import build_model", "layer 'engine' is above 'nn'"),
        ("detrain.config.values", "import detrain.run.task", "layer 'run' is above 'config'"),
        (
            "detrain.engine.predict.results",
            "def later():\n    from detrain.engine.train import trainer",
            "engine part 'train' is not below 'predict'",
        ),
        (
            "detrain.engine.telemetry.events",
            "from detrain.engine.evaluate.validator import validate",
            "engine part 'evaluate' is not below 'telemetry'",
        ),
    ],
)
def test_an_upward_import_is_caught(module: str, added: str, expected: str) -> None:
    source = MODULES[module].read_text() + "\n" + added + "\n"
    assert any(expected in line for line in upward(imports_of(module, source)))
    assert not upward(imports_of(module))


def test_a_cycle_is_caught() -> None:
    # detrain.metrics.confusion is imported by the metrics package; importing the package back closes a loop
    source = MODULES["detrain.metrics.confusion"].read_text() + "\nfrom detrain.metrics import coco_summary\n"
    found = cycles(without_known(graph({"detrain.metrics.confusion": source})))
    assert any({"detrain.metrics", "detrain.metrics.confusion"} <= set(group) for group in found)
