"""Run an example of examples/ (or a test script wrapping one) under torchrun on CPU ranks.

The examples are templates users copy; CI runs each on 2 gloo ranks and checks its exit code and
what it prints (tests/test_example_*.py). The plugin's env switches of the calling test are
dropped so an example sees a default configuration.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterable

from tests.support import REPO_ROOT

EXAMPLES = REPO_ROOT / "examples"


#: what torch itself leaves in the temp directory: torchrun's log folder, inductor's compile cache
TORCH_OWN = ("torchelastic_", "torchinductor_")


def run_example(script: str | Path, *args: str, paths: Iterable[Path] = (), nproc: int = 2,
                env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node=nproc script --device cpu args...``; ``script`` is a name under
    examples/ or a path. ``paths`` go first on PYTHONPATH (fixture sites).

    It runs with a temp directory of its own (TMPDIR), and a run that passes must leave it empty:
    examples clean up after themselves (issue 41: each veomni run left a checkpoint folder behind)."""
    script = Path(script) if os.path.isabs(str(script)) else EXAMPLES / script
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("NPU_FSDP_PATCHES")}
    run_env.update(OMP_NUM_THREADS="1", **(env or {}))
    run_env["PYTHONPATH"] = os.pathsep.join(
        [str(p) for p in paths] + [str(REPO_ROOT), str(EXAMPLES)]
        + [p for p in [os.environ.get("PYTHONPATH")] if p])
    with tempfile.TemporaryDirectory(prefix="example-tmp-") as tmp:
        run_env.setdefault("TMPDIR", tmp)
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
             str(script), "--device", "cpu", *args],
            cwd=str(REPO_ROOT), env=run_env, capture_output=True, text=True, timeout=timeout)
        left = sorted(n for n in os.listdir(tmp) if not n.startswith(TORCH_OWN))
    if proc.returncode == 0 and left:
        raise AssertionError(f"{script.name} passed but left {left} in its temp directory")
    return proc


def failure_report(proc: subprocess.CompletedProcess) -> str:
    return f"rc={proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"


VIEW_WARNING = "returned a view tensor"
