"""The shape of the house, checked on the source: imports point one way (`cluster -> workers ->
{parallel, kv}`, Ray only in `cluster/`), no module imports itself back through others, and no
file or function grows past what a reader takes in at once."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("cluster", "workers", "parallel", "kv")
# What each package may import of the others.
ALLOWED = {"cluster": {"cluster", "workers", "parallel", "kv"},
           "workers": {"workers", "parallel", "kv"},
           "parallel": {"parallel"},
           "kv": {"kv", "parallel"}}
MAX_FILE_LINES = 450
MAX_FUNCTION_LINES = 80
GENERATED = ("cluster/proto/",)


def sources(roots=PACKAGES + ("scripts", "tests")) -> Iterator[Path]:
    for root in roots:
        for path in sorted((REPO / root).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if not rel.startswith(GENERATED):
                yield path


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(tree: ast.AST) -> Iterator[Tuple[str, bool]]:
    """(module, at import time) for each absolute import; ``from P import m`` of a submodule
    ``m`` names ``P.m``. At import time: not inside a function and not under TYPE_CHECKING."""
    def walk(node: ast.AST, top: bool) -> Iterator[Tuple[str, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from walk(child, False)
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.dump(child.test):
                yield from walk(child, False)
            elif isinstance(child, ast.Import):
                yield from ((alias.name, top) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                yield child.module, top
                yield from ((f"{child.module}.{alias.name}", top) for alias in child.names)
            else:
                yield from walk(child, top)
    yield from walk(tree, True)


def import_graph() -> Dict[str, Set[str]]:
    known = {module_name(path) for path in sources(PACKAGES)}
    graph: Dict[str, Set[str]] = {}
    for path in sources(PACKAGES):
        targets = {name for name, _ in imports(ast.parse(path.read_text()))}
        graph[module_name(path)] = {name for name in targets if name in known}
    return graph


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    found: List[List[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_itself_back():
    # imports inside functions count too: a lazy import that closes a circle still ties the
    # modules into one
    assert cycles(import_graph()) == []


def test_cycles_are_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_point_down_and_ray_stays_in_cluster(package):
    wrong = []
    for path in sources((package,)):
        for name, _ in imports(ast.parse(path.read_text())):
            top = name.split(".")[0]
            if top in PACKAGES and top not in ALLOWED[package]:
                wrong.append(f"{path.relative_to(REPO)} imports {name}")
            if top == "ray" and package != "cluster":
                wrong.append(f"{path.relative_to(REPO)} imports {name}")
    assert wrong == []


def test_files_and_functions_stay_short():
    long = []
    for path in sources():
        text = path.read_text()
        rel = path.relative_to(REPO)
        if text.count("\n") > MAX_FILE_LINES:
            long.append(f"{rel}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{rel}:{node.lineno} {node.name}: {lines} lines")
    assert long == []
