"""What a patch module declares, read from its source without importing it (no torch, no target).

A patch module defines ``class X(Patch)`` with, in the class body, literal values for ``name`` (the
matrix key), ``self_test`` (its self-test check, or None) and a docstring (its one-paragraph doc).
Reading them from the syntax tree lets the plugin list the built-in patches, the self-test list its
checks and docs/patches.md be checked, all without running patch code; the class keeps the same
values at run time because they are literals.
"""
from __future__ import annotations

import ast
import importlib.util
import pkgutil
from typing import Iterable, NamedTuple, Optional

#: the keys of a ``self_test`` declaration; ``run`` is "module:function", called as function(ctx)
SELF_TEST_KEYS = ("name", "order", "run")


class Declared(NamedTuple):
    """One patch class as its module declares it."""

    name: str                   # the patch name (matrix key)
    value: str                  # "module:Class", what the loader imports
    self_test: Optional[dict]   # {"name", "order", "run"}, or None
    doc: Optional[str]          # the class docstring: the patch's one-paragraph doc
    problem: Optional[str]      # why a declaration could not be read; None when all were literals


def _is_patch_class(node: ast.AST) -> bool:
    return isinstance(node, ast.ClassDef) and any(
        (isinstance(b, ast.Name) and b.id == "Patch") or (isinstance(b, ast.Attribute) and b.attr == "Patch")
        for b in node.bases)


def _assigned(stmt: ast.stmt) -> Optional[ast.expr]:
    """The single target of ``x = ...`` or ``x: T = ...``; None for any other statement."""
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
        return stmt.targets[0]
    if isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
        return stmt.target
    return None


def _class_literals(node: ast.ClassDef) -> tuple:
    """(``name``, ``self_test``) assigned in the class body, and a problem when one is not a literal."""
    found, problem = {"name": None, "self_test": None}, None
    for stmt in node.body:
        target = _assigned(stmt)
        if isinstance(target, ast.Name) and target.id in found:
            try:
                found[target.id] = ast.literal_eval(stmt.value)
            except ValueError:
                problem = f"{node.name}.{target.id} must be a literal (line {stmt.lineno})"
    return found["name"], found["self_test"], problem


def _self_test_problem(self_test) -> Optional[str]:
    if self_test is None:
        return None
    if not isinstance(self_test, dict) or sorted(self_test) != sorted(SELF_TEST_KEYS) \
            or ":" not in str(self_test["run"]) or not isinstance(self_test["order"], int):
        return f"self_test must be None or {{'name': str, 'order': int, 'run': 'module:function'}}, not {self_test!r}"
    return None


def read_source(source: str, module: str) -> list:
    """The :class:`Declared` patch classes defined at the top level of ``source`` (module ``module``)."""
    out = []
    for node in ast.parse(source).body:
        if not _is_patch_class(node):
            continue
        name, self_test, problem = _class_literals(node)
        if not isinstance(name, str) or not name:
            continue
        problem = problem or _self_test_problem(self_test)
        out.append(Declared(name, f"{module}:{node.name}", None if problem else self_test,
                            ast.get_docstring(node), problem))
    return out


def _source(module: str) -> Optional[str]:
    spec = importlib.util.find_spec(module)
    return spec.loader.get_source(spec.name) if spec and spec.loader else None


def read_module(module: str) -> list:
    """The patch classes of importable module ``module`` (finding it imports its parent packages only);
    none for a module that cannot be found or parsed (its patch then reads as unknown in the matrix)."""
    try:
        return read_source(_source(module) or "", module)
    except (ImportError, ValueError, OSError, SyntaxError):
        return []


def read_package(package: str, path: Iterable[str]) -> list:
    """The patch classes of every module of the imported ``package`` (its ``__path__`` is ``path``), in
    module name order."""
    out = []
    for info in sorted(pkgutil.iter_modules(list(path)), key=lambda i: i.name):
        if info.ispkg:
            continue
        out += read_module(f"{package}.{info.name}")
    return out
