"""The layers drawn from the imports: no two folders import each other, no module import cycle."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: Folder (as laid out in the repository) of each import prefix, most specific first.
FOLDERS = [
    ("zephon_flow.core", "zephon_flow/core"),
    ("zephon_flow.engine", "zephon_flow/engine"),
    ("zephon_flow.service", "zephon_flow/service"),
    ("zephon_flow.cluster", "zephon_flow/cluster"),
    ("zephon_flow.operators", "operators"),
    # The backends are the runner's own parts (they run its front segment): one folder with it.
    ("zephon_flow.runners", "runners"),
    ("zephon_flow", "zephon_flow"),
]
#: What each folder may import (besides itself); the face imports everything.
ALLOWED = {
    "zephon_flow/core": set(),
    "operators": {"zephon_flow/core"},
    "runners": {"zephon_flow/core"},
    "zephon_flow/engine": {"zephon_flow/core", "operators", "runners"},
    "zephon_flow/service": {"zephon_flow/core", "zephon_flow/engine"},
    "zephon_flow/cluster": {"zephon_flow/core", "zephon_flow/engine", "runners", "zephon_flow/service"},
}


def folder_of(module: str) -> str | None:
    for prefix, folder in FOLDERS:
        if module == prefix or module.startswith(prefix + "."):
            return folder
    return None


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] in ("operators", "runners"):
        parts = ["zephon_flow", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports(path: Path) -> set[str]:
    """The zephon_flow modules a file imports (at any level, including inside functions)."""
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("zephon_flow")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("zephon_flow"):
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def package_files() -> list[Path]:
    files = [
        *ROOT.glob("zephon_flow/**/*.py"),
        *ROOT.glob("operators/**/*.py"),
        *ROOT.glob("runners/**/*.py"),
    ]
    return [f for f in files if "_proto" not in f.parts]


def known(modules: set[str], names: set[str]) -> set[str]:
    """``modules`` narrowed to real modules (``from pkg import name`` may name a class)."""
    return {m for m in modules if m in names}


def test_no_folder_imports_one_that_imports_it_back() -> None:
    edges: dict[tuple[str, str], list[str]] = {}
    for path in package_files():
        here = folder_of(module_name(path))
        for mod in imports(path):
            there = folder_of(mod)
            if here and there and there != here:
                edges.setdefault((here, there), []).append(f"{path.relative_to(ROOT)} -> {mod}")
    both = [(a, b) for (a, b) in edges if (b, a) in edges and a < b]
    assert both == [], {pair: (edges[pair][:3], edges[pair[::-1]][:3]) for pair in both}
    wrong = {(a, b): lines[:3] for (a, b), lines in edges.items() if a in ALLOWED and b not in ALLOWED[a]}
    assert wrong == {}


def test_no_module_import_cycle() -> None:
    files = {module_name(p): p for p in package_files()}
    graph = {m: known(imports(p), set(files)) - {m} for m, p in files.items()}
    # A package's __init__ re-exporting its children is not a cycle of the layers.
    graph = {
        m: {d for d in deps if not m.startswith(d + ".") and not d.startswith(m + ".")}
        for m, deps in graph.items()
    }
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return [*stack[stack.index(d) :], d]
            if d not in state and (cycle := visit(d)):
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            raise AssertionError(" -> ".join(cycle))


def test_the_checks_see_the_layers_they_police() -> None:
    names = {module_name(p) for p in package_files()}
    folders = {folder_of(n) for n in names}
    assert {
        "zephon_flow/core",
        "operators",
        "runners",
        "zephon_flow/engine",
        "zephon_flow/service",
    } <= folders
    assert list(itertools.islice(sorted(names), 1))  # files were found
