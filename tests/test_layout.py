"""The package's shape: module sizes, public function bodies, no import cycle, a curated public
face, a fast import, and a complexity allow-list that only shrinks."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import initlab

SRC = Path(initlab.__file__).parent

#: Functions allowed over ruff's mccabe limit (a ``noqa`` comment for C901). This list may only
#: shrink: a new entry means a function that should have been split.
C901_ALLOWED: frozenset[str] = frozenset()

#: Lines a public function's or method's body may take (after its docstring): it fits on a screen,
#: "validate, delegate, return".
SCREEN = 60

#: Public functions allowed a longer body, ``"path/in/initlab.py:name"`` (``Class.method`` for a
#: method) -> their limit. Empty: every long body was split into private helpers; an entry needs a
#: comment saying why that body cannot be split.
LONG_BODIES_ALLOWED: dict[str, int] = {}


def _modules() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def _body_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    body = fn.body
    first = body[0]
    docstring = isinstance(first, ast.Expr) and isinstance(
        getattr(first, "value", None), ast.Constant
    )
    start = body[1].lineno if docstring and len(body) > 1 else first.lineno
    return (fn.end_lineno or fn.lineno) - start + 1


def test_no_module_over_900_lines() -> None:
    long = {
        str(p.relative_to(SRC)): n
        for p in _modules()
        if (n := len(p.read_text().splitlines())) > 900
    }
    assert not long, long


_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _public(name: str) -> bool:
    """Not underscore-named, or a dunder (``__init__``, ``__call__``: a class's public face)."""
    return not name.startswith("_") or (name.startswith("__") and name.endswith("__"))


def _public_bodies() -> dict[str, int]:
    """``"path:name"`` -> body lines of every public module-level function and every public
    method of a public module-level class, in every module of the package."""
    found: dict[str, int] = {}
    for path in _modules():
        where = path.relative_to(SRC).as_posix()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, _DEFS) and _public(node.name):
                found[f"{where}:{node.name}"] = _body_lines(node)
            elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                for item in node.body:
                    if isinstance(item, _DEFS) and _public(item.name):
                        found[f"{where}:{node.name}.{item.name}"] = _body_lines(item)
    return found


def test_public_functions_fit_on_a_screen() -> None:
    found = _public_bodies()
    names = {key.rsplit(":", 1)[1] for key in found}
    # the walk reads the package (a broken one would find nothing too long)
    assert {"lsuv_", "diagnose", "init_model", "precondition_", "Batches.__init__"} <= names
    too_long = {k: n for k, n in found.items() if n > LONG_BODIES_ALLOWED.get(k, SCREEN)}
    assert not too_long, too_long
    stale = {k for k in LONG_BODIES_ALLOWED if found.get(k, 0) <= SCREEN}
    assert not stale, f"no longer long (or gone): remove from LONG_BODIES_ALLOWED: {sorted(stale)}"


def test_complexity_allow_list_only_shrinks() -> None:
    sites = set()
    for path in _modules():
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"noqa:.*C901", line):
                m = re.search(r"def (\w+)", line)
                sites.add(f"{path.relative_to(SRC)}:{m.group(1) if m else i}")
    assert sites <= C901_ALLOWED, sorted(sites - C901_ALLOWED)


def _name(path: Path) -> str:
    return ".".join(path.relative_to(SRC.parent).with_suffix("").parts).removesuffix(".__init__")


def _imports(path: Path) -> set[str]:
    """Modules of initlab imported at module level (not inside functions)."""
    module = _name(path)
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("initlab"):
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("initlab")}
    out.discard(module)
    return out


def test_no_import_cycle_between_modules() -> None:
    graph = {}
    for path in _modules():
        name = ".".join(path.relative_to(SRC.parent).with_suffix("").parts).removesuffix(
            ".__init__"
        )
        graph[name] = {m for m in _imports(path)}

    # A package's __init__ importing its own submodules is its public face, not a cycle.
    def edges(n: str) -> set[str]:
        return {m for m in graph.get(n, ()) if m in graph and not n.startswith(m + ".")}

    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in edges(n):
            if m.startswith(n + "."):
                continue
            if state.get(m) == 1:
                cycle = [*stack[stack.index(m) :], m]
                pytest.fail(f"import cycle: {' -> '.join(cycle)}")
            if m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)


def test_public_face_is_curated() -> None:
    names = dir(initlab)
    for plumbing in ("_core", "batches", "guard", "hooks", "rng", "reductions", "rows", "torch"):
        assert plumbing not in names, plumbing
    for public in (
        "gradient_stats",
        "layer_spectra",
        "lint_model",
        "kernel_size_alpha",
        "resnet_multipliers",
        "preconditioned_param_groups",
        "Batches",
        "criterion",
        "zoo",
        "data",
        "study",
    ):
        assert public in names, public
    assert set(initlab.__all__) <= set(names)
    for name in initlab.__all__:
        assert getattr(initlab, name) is not None, name
    assert initlab.zoo.create_model is not None and initlab.study is not None


def test_import_is_lazy_about_heavy_packages() -> None:
    code = (
        "import sys, initlab; heavy = [m for m in ('matplotlib', 'pandas', 'ray', 'yaml', "
        "'sklearn', 'transformers') if m in sys.modules]; print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
