"""The package's floor plan, checked on its import graph (issue 34).

``machinlike/distributed`` is seven private floors; each imports only the floors below it,
through their faces, lazy and type-only imports included. No module of the package is on
an import circle, and none holds more than 300 lines of code (docstrings, comments and
blank lines not counted).
"""

from __future__ import annotations

import ast
import pathlib
from typing import Dict, List, Set

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "machinlike"
FLOORS = ["_store", "_transport", "_membership", "_calls", "_groups", "_world", "_launch"]
MAX_CODE_LINES = 300


def _modules() -> Dict[str, pathlib.Path]:
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _package(name: str, path: pathlib.Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _imports(name: str, path: pathlib.Path) -> Set[str]:
    """Every machinlike module ``name`` imports, anywhere in it (functions and
    ``TYPE_CHECKING`` blocks included)."""
    found: Set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("machinlike"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package(name, path).split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("machinlike"):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in MODULES else target)
    return found & set(MODULES)


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _floor(module: str) -> str:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "distributed" and parts[2] in FLOORS else ""


def test_each_floor_imports_only_the_floors_below_it():
    upward = []
    for name, targets in GRAPH.items():
        mine = _floor(name)
        if not mine:
            continue
        for target in targets:
            theirs = _floor(target)
            if theirs and theirs != mine and FLOORS.index(theirs) > FLOORS.index(mine):
                upward.append(f"{name} -> {target}")
    assert not upward, "imports that run up a floor:\n" + "\n".join(sorted(upward))


def test_a_floor_is_entered_through_its_face():
    # ``from .._store.keys import Keys`` reaches behind the face; ``from .._store import Keys``
    # (or a submodule named through the package) does not.
    behind = []
    for name, path in MODULES.items():
        mine = _floor(name)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 2 and node.module and "." in node.module:
                floor = node.module.split(".")[0]
                if mine and floor in FLOORS and floor != mine:
                    behind.append(f"{name}: from ..{node.module} import ...")
    assert not behind, "\n".join(behind)


def _cycles() -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    out: List[List[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in GRAPH[v]:
            if w == v or w.startswith(v + "."):
                continue  # a package's face importing its own modules
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in GRAPH:
        if v not in index:
            visit(v)
    return out


def test_no_module_is_on_an_import_circle():
    assert _cycles() == []


def _code_lines(path: pathlib.Path) -> int:
    source = path.read_text()
    docstrings: Set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                docstrings.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return sum(1 for number, line in enumerate(source.splitlines(), 1)
               if line.strip() and not line.strip().startswith("#") and number not in docstrings)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_holds_more_than_300_lines_of_code(name):
    assert _code_lines(MODULES[name]) <= MAX_CODE_LINES


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_warns_when_compiled(name):
    # An invalid escape in a docstring (rst's "``x``\ d") is a SyntaxWarning from Python
    # 3.12 on, printed into users' programs whenever the module is compiled.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compile(MODULES[name].read_text(), str(MODULES[name]), "exec")
