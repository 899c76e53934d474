"""The environment that decides what detection finds, recorded by doctor and report (issue 41).

Two runs of one venv can find different frameworks: a source checkout on ``PYTHONPATH`` shadows or adds
one, and a variable can choose what a framework imports (hyper-parallel's ``HYPER_PARALLEL_PLATFORM``).
A bug report without them cannot be reproduced. The variables come from the matrix (a framework's
``environment:``), so this module names no framework; a checkout on ``PYTHONPATH`` is identified by its
git branch and commit, read from files (plan/git_tree.py).
"""
from __future__ import annotations

import os
from pathlib import Path

from ..plan import git_tree


def pythonpath_entries(environ=None) -> list:
    """Each ``PYTHONPATH`` entry in order: the path, whether it is a folder, and the git id of the checkout
    it is (or lies in), or None."""
    environ = os.environ if environ is None else environ
    out = []
    for entry in filter(None, (environ.get("PYTHONPATH") or "").split(os.pathsep)):
        folder = Path(entry)
        out.append({"path": entry, "exists": folder.is_dir(), "git": _checkout_id(folder)})
    return out


def _checkout_id(folder: Path) -> str | None:
    """The git id of the checkout ``folder`` is, or lies in (``PYTHONPATH=repo/src``)."""
    for candidate in (folder, *list(folder.parents)[:3]):
        try:
            found = git_tree.describe(candidate)
        except OSError:
            return None
        if found:
            return found
    return None


def variables(matrix, installed=(), environ=None) -> dict:
    """name -> value (None: unset) of each variable a framework of the matrix declares, where that
    framework is ``installed`` or the variable is set."""
    environ = os.environ if environ is None else environ
    names = [] if matrix is None else [v for name, spec in matrix.frameworks.items() for v in spec.environment
                                       if name in installed or v in environ]
    return {name: environ.get(name) for name in dict.fromkeys(names)}


def detection_environment(matrix, installed=(), environ=None) -> dict:
    """``installed``: the names of the frameworks detected."""
    return {"pythonpath": pythonpath_entries(environ), "variables": variables(matrix, installed, environ)}
