"""Smoke test: examples/fsdp2_vs_foreach_adamw.py under torchrun (2 CPU ranks) reports 0 mismatches."""
import os
import re
import subprocess
import sys

from tests.support import REPO_ROOT
from tests.torch_versions import needs_fsdp2_on_cpu


@needs_fsdp2_on_cpu
def test_example_reports_zero_mismatches():
    env = {k: v for k, v in os.environ.items() if not k.startswith("NPU_FSDP_PATCHES")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node=2", "examples/fsdp2_vs_foreach_adamw.py"],
                          cwd=str(REPO_ROOT), env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert re.search(r"50 steps, 2 ranks: mismatches=0\b", proc.stdout), proc.stdout
    control = int(re.search(r"param mismatches=(\d+)", proc.stdout).group(1))
    assert control > 0, proc.stdout
