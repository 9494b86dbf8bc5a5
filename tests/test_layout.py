"""The tree reads as its architecture: docs/layout.md's layers hold for every import.

Walks every import statement of every module of the library, `kernels`, `tasks` and `flows`
(those inside functions too: a lazy import is still a dependency) and checks the layer table
of docs/layout.md against it: no module imports from a layer above its own, no import cycle
among modules, every package of the tree is named in the table and every name in it exists.
Also: no module over 600 lines, and Prefect imported only by the orchestration layer and the
command line's stage commands.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LIBRARY = REPO / "src" / "gptforge"
OUTSIDE = ("kernels", "tasks", "flows")  # top-level packages beside src/
MAX_LINES = 600


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for the library and the packages beside it."""
    roots = [(REPO / "src", LIBRARY)] + [(REPO, REPO / name) for name in OUTSIDE]
    files = {}
    for base, root in roots:
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(base).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[".".join(parts)] = path
    return files


MODULES = module_files()


def imports_of(name: str, path: Path) -> set[str]:
    """The modules of this project that `name` imports (anywhere in its body)."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            # `from P import m`: the module P.m when it is one, else P itself
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:  # `import a.b.c` of a module inside a package
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


GRAPH = {name: imports_of(name, path) for name, path in MODULES.items()}


def layer_table() -> dict[str, int]:
    """docs/layout.md's `## Layers` table: package name -> layer number."""
    text = (REPO / "docs" / "layout.md").read_text(encoding="utf-8")
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    layers = {}
    for row in re.findall(r"^\| (\d+) [^|]+\| ([^|]+) \|", section, re.M):
        number, names = int(row[0]), re.findall(r"`([\w.]+)`", row[1])
        assert names, f"layer {number} of docs/layout.md names no package"
        for package in names:
            assert package not in layers, f"{package} is in two layers of docs/layout.md"
            layers[package] = number
    assert layers, "docs/layout.md has no layer table under '## Layers'"
    return layers


LAYERS = layer_table()


def package_of(module: str) -> str | None:
    """The name the layer table uses for a module: `gptforge.modeling.gpt` -> `modeling`,
    `flows.prepare` -> `flows`; the root package `gptforge` itself has none (it is the version)."""
    parts = module.split(".")
    if parts[0] != "gptforge":
        return parts[0]
    return parts[1] if len(parts) > 1 else None


def layer_of(module: str) -> int:
    package = package_of(module)
    return 0 if package is None else LAYERS[package]


def test_every_package_of_the_tree_is_in_the_layer_table_and_every_name_in_it_exists():
    in_tree = {package_of(m) for m in MODULES} - {None}
    assert in_tree - set(LAYERS) == set(), "packages or modules missing from docs/layout.md's layer table"
    assert set(LAYERS) - in_tree == set(), "names in docs/layout.md's layer table that the tree does not have"


def test_every_package_of_the_library_has_a_row_in_the_package_table():
    text = (REPO / "docs" / "layout.md").read_text(encoding="utf-8").split("## The packages", 1)[1]
    named = {
        n.rstrip("/") for cell in re.findall(r"^\| ([^|]+) \|", text, re.M) for n in re.findall(r"`([\w/]+)`", cell)
    }
    library = {package_of(m) for m in MODULES if m.startswith("gptforge.")}
    assert library - named == set(), "library packages or modules without a row in docs/layout.md's package table"
    for row_name in named - {"package"}:
        path = LIBRARY / row_name
        assert path.is_dir() or path.with_suffix(".py").is_file(), (
            f"docs/layout.md names {row_name}, which is not in src/gptforge"
        )


def test_no_import_points_up_a_layer():
    against = sorted(
        f"{m} (layer {layer_of(m)}) imports {t} (layer {layer_of(t)})"
        for m, targets in GRAPH.items()
        for t in targets
        if layer_of(t) > layer_of(m)
    )
    assert against == []


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative: the components with more than one module (the cycles)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_no_import_cycle_among_modules():
    assert strongly_connected(GRAPH) == []


def test_the_cycle_finder_finds_a_cycle():
    # The check above is only as good as this: a loop of three is found, a chain is not.
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_module_is_over_600_lines():
    long = {
        name: n
        for name, path in MODULES.items()
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert long == {}


@pytest.mark.parametrize("library", ["prefect", "flows", "tasks"])
def test_prefect_is_imported_only_by_the_orchestration_layer_and_the_stage_commands(library):
    allowed = {"cli"} if library == "flows" else set()
    importers = set()
    for name, path in MODULES.items():
        if package_of(name) in ("tasks", "flows") or name == "gptforge.cli.stages":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            if any(n == library or n.startswith(library + ".") for n in names):
                importers.add(name)
    assert importers - allowed == set()
