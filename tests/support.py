"""Shared test helpers: fixture distributions and fresh-interpreter runs.

Fixture distributions live in ``tests/fixtures/<name>/`` laid out like a site-packages folder
(the package plus a real ``<dist>-<version>.dist-info`` with METADATA and, where needed,
entry_points.txt). Tests never import them directly from the repo: ``install_fixture`` copies one
onto a temporary path, which a subprocess then gets on ``PYTHONPATH``. A fixture may list, in a
``FIXTURE_INCLUDES`` file, shared fixture folders to lay down first (both hyper-parallel generations
share their platform layer this way). TE and TENPU sites come from ``tests/te_real.py`` instead.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Iterable

REPO_ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def install_fixture(name: str, dest: Path) -> Path:
    """Copy fixture distribution ``name`` into ``dest/name`` and return that site folder."""
    site = Path(dest) / name
    if not site.exists():
        includes = FIXTURES / name / "FIXTURE_INCLUDES"
        parts = includes.read_text().split() if includes.exists() else []
        for part in [*parts, name]:
            shutil.copytree(FIXTURES / part, site, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "FIXTURE_INCLUDES"))
    return site


def run_python(code: str, *, paths: Iterable[Path] = (), env: dict | None = None,
               timeout: float = 180, cwd: Path | None = None,
               check: bool = True) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with ``paths`` prepended to PYTHONPATH.

    The child gets a clean NPU_FSDP_PATCHES* environment plus ``env``; with ``check`` a non-zero exit
    fails the calling test and shows the child's output.
    """
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("NPU_FSDP_PATCHES")}
    child_env.update({"OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"})
    child_env.update(env or {})
    extra = [str(p) for p in paths]
    if child_env.get("PYTHONPATH"):
        extra.append(child_env["PYTHONPATH"])
    child_env["PYTHONPATH"] = os.pathsep.join(extra)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=child_env,
                          cwd=str(cwd or REPO_ROOT), capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"child exited {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}"
                             f"\nstderr:\n{proc.stderr[-8000:]}")
    return proc
