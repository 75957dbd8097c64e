"""The package's shape: imports point down the pipeline's layers, never up or round, and docs/layout.md
lists every module.

Imports are read with ``ast`` from the source, lazy ones (inside functions) and type-only ones
(under ``TYPE_CHECKING``) included: an import that runs late still ties the two modules together.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mtkit"

# Lowest first. A module may import modules of its own layer and of the layers below it, never above.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("leaves", ("version", "errors", "untrusted", "files", "progress", "config", "runtime", "hub_folders")),
    ("data", ("data",)),
    ("model", ("model",)),
    ("scoring", ("scoring",)),
    ("decoding", ("decoding",)),
    ("interop", ("interop",)),
    ("translation", ("translation",)),
    ("training", ("training",)),
    ("serving", ("serving",)),
    ("workflows", ("workflows",)),
    ("entry points", ("", "__main__", "api", "cli", "commands", "launch")),
]


def module_names() -> dict[str, Path]:
    """Every module of the package by dotted name relative to ``mtkit`` (the package's face is "")."""
    names = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def module_of(dotted: str) -> str | None:
        if dotted != "mtkit" and not dotted.startswith("mtkit."):
            return None
        dotted = dotted.removeprefix("mtkit").removeprefix(".")
        while dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted

    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(module_of(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = ["mtkit", *filter(None, package.split("."))]
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:  # `from mtkit.data import tokenizer` imports a module, not a name
                submodule = f"{base}.{alias.name}"
                found.add(module_of(submodule) if submodule.removeprefix("mtkit.") in modules else module_of(base))
    return found - {None, name}


def import_graph() -> dict[str, set[str]]:
    modules = module_names()
    return {name: imported(name, path, modules) for name, path in modules.items()}


def layer_of(module: str) -> int:
    top = module.split(".")[0]
    for rank, (_, members) in enumerate(LAYERS):
        if top in members:
            return rank
    raise AssertionError(f"mtkit.{module} belongs to no layer; add its folder to LAYERS and docs/layout.md")


def upward(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"mtkit.{a or '__init__'} ({LAYERS[layer_of(a)][0]}) imports mtkit.{b or '__init__'} ({LAYERS[layer_of(b)][0]})"
        for a, targets in graph.items()
        for b in targets
        if layer_of(b) > layer_of(a)
    )


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_every_module_belongs_to_a_layer() -> None:
    for module in module_names():
        layer_of(module)


def test_imports_only_point_down() -> None:
    assert upward(import_graph()) == []


def test_no_import_cycles() -> None:
    assert cycles(import_graph()) == []


# Edges that once tied the package into one cycle or pointed up, each put back into the real graph.
REMOVED_EDGES = [
    ("runtime", "launch"),  # allocator_in_use lives beside the environment report
    ("decoding.line_translator", "interop.ct2_translator"),  # the engine switch sits above both engines (translation)
    ("model.transformer", "decoding.shortlist"),  # the model owns the type of its output candidates
    ("data.download", ""),  # __version__ comes from the leaf version module, not the package's face
]


@pytest.mark.parametrize(("source", "target"), REMOVED_EDGES)
def test_an_edge_put_back_is_refused(source: str, target: str) -> None:
    graph = import_graph()
    assert target not in graph[source]
    graph[source].add(target)
    assert any(f"mtkit.{source} (" in line for line in upward(graph))


def test_a_cycle_is_found() -> None:
    graph = import_graph()
    graph["data.tokenizer"].add("data.parallel")  # parallel imports the tokenizer, so this closes a loop
    assert ["data.parallel", "data.tokenizer"] in cycles(graph)


def test_lazy_and_type_only_imports_count(tmp_path: Path) -> None:
    source = tmp_path / "lazy.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from mtkit.decoding.shortlist import Shortlist\n"
        "def late():\n    from mtkit.serving import server\n    import mtkit.training.trainer\n"
    )
    modules = module_names()
    assert imported("model.lazy", source, modules) == {"decoding.shortlist", "serving.server", "training.trainer"}


def folders() -> list[str]:
    """The package's folders (each a layer of its own, or a part of the entry points)."""
    return sorted(path.parent.name for path in PACKAGE.glob("*/__init__.py"))


def declared_imports(folder: str) -> set[str]:
    """The layers a folder's ``__init__`` docstring says its modules import: its ``Imports:`` paragraph names
    "the leaves" and each folder as ``mtkit.FOLDER``."""
    docstring = ast.get_docstring(ast.parse((PACKAGE / folder / "__init__.py").read_text())) or ""
    paragraph = docstring.split("Imports:", 1)[1].split("\n\n")[0] if "Imports:" in docstring else ""
    named = {"leaves"} if "leaves" in paragraph else set()
    for rank, (layer, members) in enumerate(LAYERS):
        for top in filter(None, members):
            if re.search(rf"\bmtkit\.{top}\b", paragraph):
                named.add("leaves" if rank == 0 else top if layer == "entry points" else layer)
    return named


def imported_layers(folder: str, graph: dict[str, set[str]]) -> set[str]:
    """The layers (and, in the entry points, the modules) that the folder's modules import, its own excluded."""
    found = set()
    for module, targets in graph.items():
        if module.split(".")[0] != folder:
            continue
        for target in targets:
            top = target.split(".")[0]
            rank = layer_of(target)
            if top != folder:
                found.add("leaves" if rank == 0 else top if LAYERS[rank][0] == "entry points" else LAYERS[rank][0])
    return found


@pytest.mark.parametrize("folder", folders())
def test_each_folder_states_what_it_imports(folder: str) -> None:
    """A folder's ``__init__`` says what it holds and, in an ``Imports:`` paragraph, exactly which layers it
    imports: a new import of another layer, or one that is gone, makes the statement false and fails here."""
    assert declared_imports(folder) == imported_layers(folder, import_graph())


def test_a_false_imports_statement_is_found() -> None:
    graph = import_graph()
    graph["data.parallel"].add("model.transformer")
    assert imported_layers("data", graph) - declared_imports("data") == {"model"}


LAYOUT = ROOT / "docs" / "layout.md"


def test_layout_doc_lists_every_module() -> None:
    text = LAYOUT.read_text()
    listed = set(
        re.findall(r"`((?:[a-z0-9_]+/)*[a-z0-9_]+\.py)`", text.split("## `mtkit/`")[1].split("## Elsewhere")[0])
    )
    on_disk = {str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")}
    on_disk -= {name for name in on_disk if name.endswith("/__init__.py")}  # a folder's docstring, not a module
    assert sorted(on_disk - listed) == [], "modules missing from docs/layout.md"
    assert sorted(listed - on_disk) == [], "docs/layout.md lists modules that do not exist"


def test_layout_doc_gives_the_layer_order() -> None:
    order = LAYOUT.read_text().split("## Layers")[1].split("\n## ")[0]
    positions = [order.find(f"**{name}**") for name, _ in LAYERS]
    assert -1 not in positions and positions == sorted(positions)


@pytest.mark.parametrize("script", sorted((ROOT / "benchmarks").glob("*.py")), ids=lambda path: path.name)
def test_each_benchmark_script_imports(script, monkeypatch):
    """A benchmark imports mtkit's names at its top: a name moved or renamed in the package breaks it here, not
    when someone next runs it. Imported as ``python benchmarks/NAME.py`` runs it: its folder on the path."""
    monkeypatch.syspath_prepend(str(script.parent))
    spec = importlib.util.spec_from_file_location(script.stem, script)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, script.stem, module)
    spec.loader.exec_module(module)


def test_the_built_package_marks_itself_typed(tmp_path: Path) -> None:
    """PEP 561: type checkers read an installed package's annotations only when it ships ``py.typed``. The wheel
    (what pip installs) is built from a copy, so that the build writes nothing into the repository."""
    source = tmp_path / "source"
    shutil.copytree(PACKAGE, source / "mtkit", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    script = "import sys, setuptools.build_meta as build; print(build.build_wheel(sys.argv[1]))"
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "dist")], cwd=source, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    with zipfile.ZipFile(tmp_path / "dist" / done.stdout.split()[-1]) as wheel:
        assert "mtkit/py.typed" in wheel.namelist()
