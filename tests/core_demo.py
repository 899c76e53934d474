"""Helpers for the plugin-core tests that run against the core_demo fixture distributions."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.support import install_fixture, run_python

PRELUDE = """
import json, logging, sys
logging.basicConfig(level=logging.WARNING, format="LOG %(levelname)s %(message)s")
def records():
    import npu_fsdp_patches
    return {r["name"]: r for r in npu_fsdp_patches.status()}
def emit(**values):
    print("RESULT " + json.dumps(values, default=str))
"""

#: child body that imports the plugin and reports what (if anything) the import raised
IMPORT_PLUGIN = """
try:
    import npu_fsdp_patches
    emit(raised=False)
except Exception as exc:
    emit(raised=type(exc).__name__, message=str(exc))
"""


#: the head of a matrix over the demo framework; ``demo_matrix`` appends the patches
DEMO_MATRIX_HEAD = """schema_version: 1
frameworks:
  demo: {distributions: [demo-framework], module: demo_target}
patches:
"""


def demo_matrix(path: Path, patches: str) -> Path:
    """Write a matrix over the demo framework with the ``patches`` section body (YAML) to ``path``."""
    path.write_text(DEMO_MATRIX_HEAD + patches)
    return path


def demo_env(site: Path, matrix: str = "demo_matrix.yaml", **extra: str) -> dict:
    env = {"NPU_FSDP_PATCHES_MATRIX": str(site / matrix)}
    env.update(extra)
    return env


def run_demo(tmp_path: Path, code: str, *, matrix: str = "demo_matrix.yaml", check: bool = True,
             **env: str):
    """Run PRELUDE + code with the demo fixtures on the path; return (result dict, process)."""
    site = install_fixture("core_demo", tmp_path)
    proc = run_python(PRELUDE + code, paths=[site], env=demo_env(site, matrix, **env), check=check)
    lines = [line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    return (json.loads(lines[-1]) if lines else None), proc


def late_demo_site(tmp_path: Path) -> tuple[Path, Path]:
    """The demo fixtures with the demo framework moved to a second folder: (the site, the late folder)
    for a framework put on sys.path after activation."""
    site = install_fixture("core_demo", tmp_path)
    late = tmp_path / "late"
    late.mkdir()
    for name in ("demo_target", "demo_framework-1.2.0.dist-info"):
        shutil.move(str(site / name), str(late / name))
    return site, late
