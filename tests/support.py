"""Shared test helpers: fixture distributions, fresh-interpreter runs, named checks, bit comparison.

Fixture distributions live in ``tests/fixtures/<name>/`` laid out like a site-packages folder
(the package plus a real ``<dist>-<version>.dist-info`` with METADATA and, where needed,
entry_points.txt). Tests never import them directly from the repo: ``install_fixture`` copies one
onto a temporary path, which a subprocess then gets on ``PYTHONPATH``. A fixture may list, in a
``FIXTURE_INCLUDES`` file, shared fixture folders to lay down first (both hyper-parallel generations
share their platform layer this way). TE and TENPU sites come from ``tests/te_real.py``; site fixtures for tests are in tests/conftest.py.

Child code lives in importable functions: ``run_case("tests.children.x:case", args=...)`` runs one in
a fresh interpreter (tests/distributed.py ``run_ranks`` does the same on N gloo ranks). A launch that
checks many facts records each with ``Checks`` and returns ``checks.results``; the pytest side runs
the launch once in a module-scoped fixture and asserts each check in its own test (``assert_check``).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable, Iterable

import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"

#: the torch releases the shipped matrix verifies, from their one home, compat_matrix.yaml's
#: defaults.verified (CI runs each: .ci/older-torch.env reads the same list); read as plain YAML so
#: that collecting tests does not import, and so activate, npu_fsdp_patches
VERIFIED_TORCH = list(yaml.safe_load((REPO_ROOT / "compat_matrix.yaml").read_text())
                      ["defaults"]["verified"]["torch"])


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


def load_fixture_module(relpath: str) -> Any:
    """A plain module of ``tests/fixtures`` loaded by path (a stand-in that must not be importable by its
    upstream name, so no fixture tree grows the module a patch probes for)."""
    import importlib.util
    path = FIXTURES / relpath
    spec = importlib.util.spec_from_file_location(f"fixture_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def run_case(target: str, *, args: dict | None = None, paths: Iterable[Path] = (),
             env: dict | None = None, timeout: float = 180, cwd: Path | None = None) -> Any:
    """Call ``target`` ("tests.module:function") with ``args`` in a fresh interpreter; return its result.

    ``paths`` come first on the child's PYTHONPATH (fixture sites), then the repo root, so a case
    module imports like any test module. The result travels back as JSON (``default=str``). ``cwd``
    (default: the repo root, which ``python -c`` puts before PYTHONPATH) is where the child runs.
    """
    code = (f"import json\nfrom tests.support import _call_case\n"
            f"print('RESULT ' + json.dumps(_call_case({target!r}, {json.dumps(args or {})!r}), default=str))")
    proc = run_python(code, paths=[*paths, REPO_ROOT], env=env, timeout=timeout, cwd=cwd)
    lines = [line[len("RESULT "):] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"{target} printed no result\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1])


def _call_case(target: str, args_json: str) -> Any:
    import importlib
    module_name, func_name = target.split(":")
    return getattr(importlib.import_module(module_name), func_name)(**json.loads(args_json))


def make_dist(site: Path, name: str, version: str, modules: dict, top_level: str | None = None) -> None:
    """Write a minimal installed distribution: .dist-info with METADATA plus module files."""
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "RECORD").write_text("".join(f"{rel},,\n" for rel in modules))
    if top_level:
        (info / "top_level.txt").write_text(top_level + "\n")
    for rel, text in modules.items():
        path = site / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


class Checks:
    """Named checks of one launch: each runs once and records ``None`` (held) or why it failed.

    Use ``checks.run(name, fn)`` or decorate with ``@checks(name)``, which runs the function at once,
    so a check cannot be written and then forgotten. The pytest side declares the names it expects
    and asserts each with ``assert_check``; a declared name that was never run fails there.
    """

    def __init__(self) -> None:
        self.results: dict[str, str | None] = {}

    def run(self, name: str, fn: Callable[[], None]) -> None:
        if name in self.results:
            raise ValueError(f"check {name!r} recorded twice")
        try:
            fn()
        except Exception as exc:  # recorded, asserted by the pytest side
            self.results[name] = f"{type(exc).__name__}: {exc}"[:2000]
        else:
            self.results[name] = None

    def __call__(self, name: str) -> Callable[[Callable[[], None]], Callable[[], None]]:
        def decorate(fn: Callable[[], None]) -> Callable[[], None]:
            self.run(name, fn)
            return fn
        return decorate


def assert_check(results: list[dict], name: str, declared: Iterable[str]) -> None:
    """Check ``name`` ran and held on every rank; ``results``: each rank's return value, whose
    ``"checks"`` are its ``Checks.results``. A check a rank ran but ``declared`` lacks (so no test
    of its own) fails too."""
    for rank, result in enumerate(results):
        checks = result["checks"]
        assert name in checks, f"rank {rank}: check {name!r} was never run"
        assert checks[name] is None, f"rank {rank}: {name}: {checks[name]}"
        undeclared = sorted(set(checks) - set(declared))
        assert not undeclared, f"rank {rank}: checks without a test of their own: {undeclared}"


def bit_mismatches(a, b) -> tuple[int, str]:
    """Elements of tensors ``a`` and ``b`` whose bits differ, and the first one described.

    The self-test engine's comparer (``npu_fsdp_patches.selftest.checks.compare.Comparison.exact``):
    NaN-safe (compares bit patterns); a DTensor is compared as its full tensor (a collective, so every
    rank must call this); a shape or dtype difference counts every element. ``(0, "")`` means equal.
    """
    import torch
    from npu_fsdp_patches.selftest.checks.compare import Comparison, full
    a, b = full(a), full(b)
    cmp = Comparison()
    cmp.exact("", a, b)
    if cmp.mismatches == 0:
        return 0, ""
    first = cmp.first
    if first["expected_bits"] is None:
        return cmp.mismatches, f"shape/dtype {first['expected']} vs {first['got']}"
    flat, size = 0, 1
    shape = torch.view_as_real(a).shape if a.is_complex() else a.shape   # the comparer's (real, imag) pairs
    for i, extent in reversed(list(zip(first["index"], shape))):
        flat, size = flat + i * size, size * extent
    return cmp.mismatches, f"flat index {flat}: {first['expected']!r} vs {first['got']!r}"
