"""The package's structure rules, read from the source with ``ast`` (function-level imports included).

- no import circle between daskgen's modules, nor between its folders (no two folders of ``daskgen/`` import each
  other, directly or through others);
- ``store/`` imports nothing that reads stores or runs a run (``formats/``, ``stream/``, ``analysis/``, ``client/``,
  ``worker/``), and ``formats/`` nothing of the entry points that write through it (``stream/``, ``analysis/``,
  the CLI);
- within ``store/``, imports go one way: ``store/objects/`` imports nothing else of ``store/``; ``store/chunks/`` and
  ``store/records/`` import of ``store/`` only where a store lives, its layout, attrs and the commit log's keys (no
  store object, nothing of each other); nothing of ``store/`` but ``store/tools/`` imports ``store/tools/``;
- no module imports another module's private (underscore) names or reaches them as ``module._name`` (attribute,
  ``getattr``/``setattr``, ``monkeypatch.setattr``), and tests do neither with daskgen's;
- no module over 450 lines, in ``daskgen/`` or ``benchmarks/``;
- ``worker/`` names the process that runs each part: the scheduler's part (``worker/scheduler.py``) and the nanny's
  (``worker/nanny.py``) import nothing of the worker's code but the drain RPC (``worker/drain.py``, which imports no
  other worker module), and the rest of daskgen takes the messages of a partition task from ``worker/task.py``.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "daskgen"
MAX_LINES = 450


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.cache
def _tree(path: Path) -> ast.Module:
    """The parsed file, once per test process: the checks below walk every module's tree, none changes it."""
    return ast.parse(path.read_text())


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if path.name != "__init__.py":
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _imports(module: str, path: Path, known: dict[str, Path]) -> list[tuple[str, str | None]]:
    """(imported daskgen module, imported name or None) for every import statement in the file."""
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names if alias.name.startswith("daskgen")]
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, path, node)
            if not source.startswith("daskgen"):
                continue
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                found.append((submodule, None) if submodule in known else (source, alias.name))
    return found


def _graph() -> dict[str, set[str]]:
    known = _modules()
    graph: dict[str, set[str]] = {}
    for module, path in known.items():
        targets = {target for target, _ in _imports(module, path, known)}
        # a package's __init__ is where its names come from: ``from daskgen.x import y`` depends on ``daskgen.x``
        graph[module] = {t for t in targets if t in known and t != module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _is_package_init(module: str) -> bool:
    return (PACKAGE.parent / module.replace(".", "/") / "__init__.py").exists()


def test_no_import_circles_between_modules() -> None:
    graph = _graph()
    # a package's __init__ that re-exports its own submodules is not a circle of code: leave those edges out
    for module in graph:
        graph[module] = {t for t in graph[module] if not (_is_package_init(module) and t.startswith(module + "."))}
    assert _cycles(graph) == []


def _folder(module: str) -> str | None:
    """The folder of ``daskgen/`` a module lies in (``daskgen.store.layout`` -> ``store``), ``None`` at the top."""
    parts = module.split(".")
    if len(parts) > 2 or (len(parts) == 2 and _is_package_init(module)):
        return parts[1]
    return None


def _folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Folder -> the other folders its modules import (every import: module level, in functions, type-only)."""
    folders: dict[str, set[str]] = {}
    for module, targets in graph.items():
        source = _folder(module)
        if source is not None:
            found = {_folder(t) for t in targets} - {source, None}
            folders.setdefault(source, set()).update(f for f in found if f is not None)
    return folders


def test_no_import_circles_between_folders() -> None:
    """The folders of ``daskgen/`` form layers: no two import each other, directly or through a circle."""
    graph = _graph()
    circles = _cycles(_folder_graph(graph))
    ties = {
        f"{m} imports {t}"
        for m, targets in graph.items()
        for t in targets
        if any(_folder(m) in c and _folder(t) in c and _folder(m) != _folder(t) for c in circles)
    }
    assert circles == [], sorted(ties)


def test_the_folder_graph_sees_a_folder_circle() -> None:
    """The folder check can fail: two modules of two folders importing each other make a circle of folders."""
    graph = {"daskgen.store.layout": {"daskgen.input.rows"}, "daskgen.input.rows": {"daskgen.store.layout"}}
    assert _cycles(_folder_graph(graph)) == [["input", "store"]]


@pytest.mark.parametrize("module", ["daskgen.worker.scheduler", "daskgen.worker.nanny"])
def test_the_scheduler_and_nanny_parts_import_no_worker_code_but_the_drain_rpc(module: str) -> None:
    graph = _graph()
    assert {t for t in graph[module] if t.startswith("daskgen.worker")} <= {"daskgen.worker.drain"}
    assert {t for t in graph["daskgen.worker.drain"] if t.startswith("daskgen.")} == set()


def _named_imports(keep: Callable[[str, str, str], bool]) -> list[str]:
    """Every ``from source import name`` of daskgen's modules that ``keep(module, source, name)`` selects."""
    known = _modules()
    return sorted(
        f"{module} imports {name} from {source}"
        for module, path in known.items()
        for source, name in _imports(module, path, known)
        if name and keep(module, source, name)
    )


def test_the_partition_task_messages_are_taken_from_their_own_module() -> None:
    messages = {"PartitionTask", "PartitionResult"}
    assert _named_imports(lambda _, source, name: name in messages and source != "daskgen.worker.task") == []


@pytest.mark.parametrize("layer", ["formats", "stream", "analysis", "client", "worker"])
def test_the_store_imports_nothing_from_the_layers_above_it(layer: str) -> None:
    graph = _graph()
    upward = {(m, t) for m, targets in graph.items() if m.startswith("daskgen.store") for t in targets}
    assert {(m, t) for m, t in upward if t.startswith(f"daskgen.{layer}")} == set()


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


#: What the store's parts below the store object may import of the rest of ``store/``.
_UNDER_THE_STORE_OBJECT = {
    "daskgen.store.location",
    "daskgen.store.layout",
    "daskgen.store.attrs",
    "daskgen.store.commit_log",
}


@pytest.mark.parametrize(
    ("part", "allowed"),
    [("objects", set()), ("chunks", _UNDER_THE_STORE_OBJECT), ("records", _UNDER_THE_STORE_OBJECT)],
)
def test_the_store_parts_under_the_store_object_import_only_what_lies_under_them(part: str, allowed: set[str]) -> None:
    graph = _graph()
    package = f"daskgen.store.{part}"
    found = {
        (m, t)
        for m, targets in graph.items()
        if _inside(m, package)
        for t in targets
        if _inside(t, "daskgen.store") and not _inside(t, package) and t not in allowed
    }
    assert found == set()


def test_no_part_of_the_store_but_its_tools_imports_the_tools() -> None:
    graph = _graph()
    found = {
        (m, t)
        for m, targets in graph.items()
        if _inside(m, "daskgen.store") and not _inside(m, "daskgen.store.tools")
        for t in targets
        if _inside(t, "daskgen.store.tools")
    }
    assert found == set()


@pytest.mark.parametrize("caller", ["stream", "analysis", "cli"])
def test_the_formats_import_nothing_of_the_entry_points_that_call_them(caller: str) -> None:
    graph = _graph()
    found = {(m, t) for m, targets in graph.items() if m.startswith("daskgen.formats") for t in targets}
    assert {(m, t) for m, t in found if t == f"daskgen.{caller}" or t.startswith(f"daskgen.{caller}.")} == set()


def test_no_module_imports_another_modules_private_names() -> None:
    def private(module: str, source: str, name: str) -> bool:
        return name.startswith("_") and not name.startswith("__") and source != module

    assert _named_imports(private) == []


def _module_aliases(tree: ast.AST, module: str, path: Path | None, known: dict[str, Path]) -> dict[str, str]:
    """Local name -> daskgen module, for every import that binds a daskgen module to a name."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known and alias.asname:
                    aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, path, node) if path is not None else (node.module or "")
            for alias in node.names:
                if f"{source}.{alias.name}" in known:
                    aliases[alias.asname or alias.name] = f"{source}.{alias.name}"
    return aliases


def _private_reaches(tree: ast.AST, aliases: dict[str, str], own: str | None = None) -> list[str]:
    """``alias._name`` reaches into a daskgen module other than ``own``: attribute access, and the name given as a
    string to ``getattr``, ``setattr``, ``hasattr``, ``delattr`` or ``monkeypatch.setattr``/``delattr``."""

    def private(name: object) -> bool:
        return isinstance(name, str) and name.startswith("_") and not name.startswith("__")

    def target(node: ast.AST) -> str | None:
        name = aliases.get(node.id) if isinstance(node, ast.Name) else None
        return name if name != own else None

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr) and target(node.value):
            found.append(f"{target(node.value)}.{node.attr} (line {node.lineno})")
        elif isinstance(node, ast.Call) and len(node.args) >= 2 and target(node.args[0]):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            second = node.args[1]
            named = name in {"getattr", "setattr", "hasattr", "delattr"} and isinstance(second, ast.Constant)
            if named and private(second.value):
                found.append(f"{target(node.args[0])}.{second.value} (line {node.lineno})")
    return found


def test_no_module_reaches_another_modules_private_names_as_attributes() -> None:
    known = _modules()
    found = sorted(
        f"{module}: {reach}"
        for module, path in known.items()
        for tree in [_tree(path)]
        for reach in _private_reaches(tree, _module_aliases(tree, module, path, known), own=module)
    )
    assert found == []


def test_tests_reach_no_private_names_of_daskgen_modules() -> None:
    """Tests go through public seams: no ``module._name`` (read, set or monkeypatched) of a daskgen module."""
    known = _modules()
    found = sorted(
        f"{path.name}: {reach}"
        for path in (REPO / "tests").rglob("*.py")
        for tree in [_tree(path)]
        for reach in _private_reaches(tree, _module_aliases(tree, "tests", None, known))
    )
    assert found == []


def test_the_private_reach_finder_finds_attribute_and_setattr_reaches() -> None:
    """The checks above can fail: a read, an assignment and a monkeypatch of a module's private name are found."""
    source = (
        "import daskgen.config as cfg\nfrom daskgen.analysis import export as ex\n"
        "cfg._DECLARED\nex._X = 1\nmonkeypatch.setattr(ex, '_Y', 1)\nex.public\nself._z\n"
    )
    tree = ast.parse(source)
    found = _private_reaches(tree, _module_aliases(tree, "tests", None, _modules()))
    assert found == [
        "daskgen.config._DECLARED (line 3)",
        "daskgen.analysis.export._X (line 4)",
        "daskgen.analysis.export._Y (line 5)",
    ]


def test_tests_import_no_private_names_of_daskgen() -> None:
    """Tests go through public seams: no ``from daskgen.x import _name`` in tests/."""
    private = sorted(
        f"{path.name} imports {alias.name} from {node.module}"
        for path in (REPO / "tests").rglob("*.py")
        for node in ast.walk(_tree(path))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("daskgen")
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
    )
    assert private == []


@pytest.mark.parametrize("folder", ["daskgen", "benchmarks"])
def test_no_module_is_over_the_size_limit(folder: str) -> None:
    sizes = {str(p.relative_to(REPO)): len(p.read_text().splitlines()) for p in (REPO / folder).rglob("*.py")}
    assert sizes, f"no modules found under {folder}/"
    assert {path: n for path, n in sizes.items() if n > MAX_LINES} == {}


def test_the_cycle_finder_finds_a_circle() -> None:
    """The check above can fail: a two-module circle and a three-module circle are both found."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}}
    assert sorted(_cycles(graph)) == [["a", "b"], ["c", "d", "e"]]
