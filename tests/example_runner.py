"""Run an example of examples/ (or a test script wrapping one) under torchrun on CPU ranks.

The examples are templates users copy; CI runs each on 2 gloo ranks and checks its exit code and
what it prints (tests/test_example_*.py). The plugin's env switches of the calling test are
dropped so an example sees a default configuration.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Iterable

from tests.support import REPO_ROOT

EXAMPLES = REPO_ROOT / "examples"


def run_example(script: str | Path, *args: str, paths: Iterable[Path] = (), nproc: int = 2,
                env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node=nproc script --device cpu args...``; ``script`` is a name under
    examples/ or a path. ``paths`` go first on PYTHONPATH (fixture sites)."""
    script = Path(script) if os.path.isabs(str(script)) else EXAMPLES / script
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("NPU_FSDP_PATCHES")}
    run_env.update(OMP_NUM_THREADS="1", **(env or {}))
    run_env["PYTHONPATH"] = os.pathsep.join(
        [str(p) for p in paths] + [str(REPO_ROOT), str(EXAMPLES)]
        + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
         str(script), "--device", "cpu", *args],
        cwd=str(REPO_ROOT), env=run_env, capture_output=True, text=True, timeout=timeout)


def failure_report(proc: subprocess.CompletedProcess) -> str:
    return f"rc={proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"


VIEW_WARNING = "returned a view tensor"
