"""The package's layers, read from the source: no import cycle, no import against the arrows.

layout (0) -> engine (1) -> {checkpoint, optim, observability} (2) -> lightning (3) -> cli (4).
A module may import its own subpackage and lower layers only; the three layer-2 siblings
must not import each other. The root ``__init__.py`` and the thin ``python -m`` entries
(``plan.py``, ``consolidate.py``) are the top and may import anything; nothing imports them.

Every module is parsed (``ast``, nothing is imported), and every import counts: module
level, inside functions, under ``if TYPE_CHECKING:``, and ``importlib.import_module("...")``
with a literal name. Implicit parent-package imports (``a.b.c`` running ``a/__init__.py``)
are not edges: only the module an import names.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "lightning_ragged"

LAYERS = {"layout": 0, "engine": 1, "checkpoint": 2, "optim": 2, "observability": 2, "lightning": 3, "cli": 4}
TOP = 5
"""The root ``__init__.py`` and the top-level entry modules (``plan.py``, ``consolidate.py``)."""

ENGINE_MAX_LINES = 450


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    file: Path
    line: int

    def where(self) -> str:
        return f"{self.file}:{self.line}"


def module_names(root: Path) -> dict[str, Path]:
    """Every module under ``root`` by dotted name (a package by its ``__init__.py``)."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = (root.name, *path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _top_level_names(package: str, tree: ast.Module) -> set[str]:
    """Names a package's ``__init__`` binds on import: ``from pkg import name`` gets these, not a submodule.

    An ``__init__`` importing its own submodule (``from . import x``) binds the submodule, so that stays one.
    """
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Import):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            dotted = _absolute(package, node)
            names.update(
                alias.asname or alias.name
                for alias in node.names
                if f"{dotted}.{alias.name}" != f"{package}.{alias.asname or alias.name}"
            )
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(target.id for target in targets if isinstance(target, ast.Name))
    return names


def _absolute(package: str, node: ast.ImportFrom) -> str:
    """The dotted module a ``from ... import`` names, relative levels resolved against ``package``."""
    if not node.level:
        return node.module or ""
    base = package.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imported_names(module: str, path: Path, tree: ast.Module) -> Iterator[tuple[str, int, str | None]]:
    """``(dotted module, line, imported name or None)`` for every import statement anywhere in ``tree``."""
    package = module if _is_package(path) else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno, None
        elif isinstance(node, ast.ImportFrom):
            dotted = _absolute(package, node)
            for alias in node.names:
                yield dotted, node.lineno, alias.name
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, (ast.Attribute, ast.Name))
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.args[0].value, node.lineno, None


def _resolve(dotted: str, name: str | None, modules: dict[str, Path], bound: dict[str, set[str]]) -> str | None:
    """The internal module an import names, or None for an external one."""
    if name is not None and name != "*":
        candidate = f"{dotted}.{name}"
        if candidate in modules and name not in bound.get(dotted, set()):
            return candidate
    parts = dotted.split(".")
    while parts:
        if ".".join(parts) in modules:
            return ".".join(parts)
        parts.pop()
    return None


@dataclass
class Graph:
    root: Path
    modules: dict[str, Path]
    edges: list[Edge]
    trees: dict[str, ast.Module]


def import_graph(root: Path) -> Graph:
    """Parse every module under ``root`` (a package directory) and resolve its internal imports."""
    modules = module_names(root)
    trees = {module: ast.parse(path.read_text(), filename=str(path)) for module, path in modules.items()}
    bound = {module: _top_level_names(module, trees[module]) for module, path in modules.items() if _is_package(path)}
    edges = []
    for module, path in modules.items():
        for dotted, line, name in _imported_names(module, path, trees[module]):
            target = _resolve(dotted, name, modules, bound)
            if target is not None and target != module:
                edges.append(Edge(module, target, path.relative_to(root.parent), line))
    return Graph(root, modules, edges, trees)


def layer_of(module: str) -> tuple[int, str]:
    """``(layer, subpackage)`` of a dotted module name; the top for the root package and its direct modules."""
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in LAYERS:
        return LAYERS[parts[1]], parts[1]
    return TOP, "<top>"


def back_arrows(graph: Graph) -> list[str]:
    """Every edge against the layering, as a readable line."""
    problems = []
    for edge in graph.edges:
        (source_layer, source_package), (target_layer, target_package) = layer_of(edge.source), layer_of(edge.target)
        if source_layer == TOP or source_package == target_package or target_layer < source_layer:
            continue
        reason = "a sibling" if target_layer == source_layer else "a higher layer"
        problems.append(
            f"{edge.where()}: {edge.source} imports {edge.target}: {source_package} (layer {source_layer}) "
            f"must not import {target_package} (layer {target_layer}, {reason})"
        )
    return problems


def cycles(graph: Graph) -> list[list[str]]:
    """One concrete cycle per strongly connected component with more than one module (Tarjan)."""
    successors: dict[str, set[str]] = {module: set() for module in graph.modules}
    for edge in graph.edges:
        successors[edge.source].add(edge.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(successors[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == module:
                    break
            if len(component) > 1:
                components.append(component)

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return [_cycle_in(component, successors) for component in components]


def _cycle_in(component: set[str], successors: dict[str, set[str]]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first search back to it)."""
    start = min(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            for target in sorted(successors[module] & component):
                if target == start:
                    path = [module]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [*reversed(path), start]
                if target not in parents:
                    parents[target] = module
                    following.append(target)
        frontier = following
    raise AssertionError(f"no cycle in strongly connected component {sorted(component)}")


def distributed_imports(graph: Graph, subpackage: str) -> list[str]:
    """Lines of ``subpackage`` that import ``torch.distributed`` (or anything under it)."""
    found = []
    prefix = f"{graph.root.name}.{subpackage}"
    for module, tree in graph.trees.items():
        if module != prefix and not module.startswith(prefix + "."):
            continue
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            if any(name == "torch.distributed" or name.startswith("torch.distributed.") for name in names):
                found.append(f"{graph.modules[module].relative_to(graph.root.parent)}:{node.lineno}")
    return found


# ----------------------------------------------------------------------------------------------
# The package
# ----------------------------------------------------------------------------------------------


def test_graph_is_not_vacuous() -> None:
    graph = import_graph(PACKAGE_ROOT)
    assert len(graph.modules) > 40, f"found only {len(graph.modules)} modules under {PACKAGE_ROOT}"
    assert len(graph.edges) > 100, f"found only {len(graph.edges)} internal import edges"
    assert {layer_of(module)[1] for module in graph.modules} == set(LAYERS) | {"<top>"}
    lazy = ("lightning_ragged", "lightning_ragged.optim")
    assert any((edge.source, edge.target) == lazy for edge in graph.edges), (
        "the root's importlib.import_module('lightning_ragged.optim') was not seen"
    )


def describe_cycle(graph: Graph, cycle: list[str]) -> str:
    """``a -> b -> a`` with the file and line of every arrow."""
    where = {(edge.source, edge.target): edge.where() for edge in reversed(graph.edges)}
    arrows = [f"{source} -> {target} ({where[source, target]})" for source, target in zip(cycle, cycle[1:])]
    return "cycle: " + " -> ".join(cycle) + "\n    " + "\n    ".join(arrows)


def test_no_import_cycles() -> None:
    graph = import_graph(PACKAGE_ROOT)
    found = cycles(graph)
    assert not found, "import cycles between modules:\n" + "\n".join(describe_cycle(graph, cycle) for cycle in found)


def test_imports_follow_the_layers() -> None:
    problems = back_arrows(import_graph(PACKAGE_ROOT))
    assert not problems, (
        "imports against layout -> engine -> {checkpoint, optim, observability} -> lightning -> cli:\n"
        + "\n".join(problems)
    )


def test_layout_never_imports_torch_distributed() -> None:
    found = distributed_imports(import_graph(PACKAGE_ROOT), "layout")
    assert not found, "layout/ must stay pure (no torch.distributed); imported at:\n" + "\n".join(found)


def test_engine_files_stay_small() -> None:
    long = {
        path.name: lines
        for path in sorted((PACKAGE_ROOT / "engine").glob("*.py"))
        if (lines := len(path.read_text().splitlines())) > ENGINE_MAX_LINES
    }
    assert not long, f"engine files over {ENGINE_MAX_LINES} lines (split them by idea): {long}"


# ----------------------------------------------------------------------------------------------
# The checker itself, on a synthetic package
# ----------------------------------------------------------------------------------------------


def _write(root: Path, files: dict[str, str]) -> Path:
    package = root / PACKAGE_ROOT.name
    for relative, text in files.items():
        path = package / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return package


def test_checker_sees_lazy_relative_and_type_checking_back_arrows(tmp_path: Path) -> None:
    package = _write(
        tmp_path,
        {
            "__init__.py": "from lightning_ragged.cli import main\n",
            "layout/__init__.py": "",
            "layout/spec.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n"
                "    from lightning_ragged.engine.api import fully_shard\n"
            ),
            "engine/__init__.py": "",
            "engine/api.py": "from ..layout import spec\n\ndef f():\n    from ..optim import muon\n",
            "optim/__init__.py": "",
            "optim/muon.py": (
                "from lightning_ragged.engine import api\n\ndef g():\n    import lightning_ragged.checkpoint.core\n"
            ),
            "checkpoint/__init__.py": "",
            "checkpoint/core.py": "from lightning_ragged import engine\n",
            "engine/meta.py": "import os\n\ndef h():\n    from lightning_ragged import main\n",
            "cli/__init__.py": "main = None\n",
        },
    )
    graph = import_graph(package)
    problems = back_arrows(graph)
    expected = [
        "layout/spec.py:3: lightning_ragged.layout.spec imports lightning_ragged.engine.api",
        "engine/api.py:4: lightning_ragged.engine.api imports lightning_ragged.optim.muon",
        "optim/muon.py:4: lightning_ragged.optim.muon imports lightning_ragged.checkpoint.core",
        "engine/meta.py:4: lightning_ragged.engine.meta imports lightning_ragged: engine (layer 1) must not "
        "import <top>",
    ]
    for line in expected:
        assert any(problem.startswith(f"lightning_ragged/{line}") for problem in problems), (line, problems)
    assert len(problems) == len(expected), problems
    api, spec = "lightning_ragged.engine.api", "lightning_ragged.layout.spec"
    assert cycles(graph) == [[api, spec, api]]


def test_checker_reports_a_cycle_and_torch_distributed(tmp_path: Path) -> None:
    package = _write(
        tmp_path,
        {
            "__init__.py": "",
            "layout/__init__.py": "from . import a\n",
            "layout/a.py": "from . import b\n",
            "layout/b.py": "def f():\n    from lightning_ragged.layout.c import x\n",
            "layout/c.py": "import torch.distributed as dist\nfrom lightning_ragged.layout import a\nx = 1\n",
        },
    )
    graph = import_graph(package)
    assert back_arrows(graph) == []
    a, b, c = (f"lightning_ragged.layout.{name}" for name in "abc")
    assert cycles(graph) == [[a, b, c, a]]
    assert distributed_imports(graph, "layout") == ["lightning_ragged/layout/c.py:1"]
