"""Smoke test: examples/fsdp2_main_params_muon.py under torchrun (2 CPU ranks)."""
import os
import re
import subprocess
import sys

from tests.support import REPO_ROOT
from tests.torch_versions import needs_muon


@needs_muon   # the example trains Muon + AdamW; the AdamW-only path runs in the acceptance test
def test_example_trains_saves_and_resumes(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "examples/fsdp2_main_params_muon.py", "--steps", "4", "--ckpt", str(tmp_path / "ckpt")],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-6000:]
    losses = [float(x) for x in re.findall(r"^step \d+ loss ([\d.]+)$", proc.stdout, re.M)]
    assert len(losses) == 4 and all(b < a for a, b in zip(losses, losses[1:]))
    assert len(re.findall(r"^resumed step \d+ loss", proc.stdout, re.M)) == 2
    assert "load branch: main_params" in proc.stdout
    assert "resume matches uninterrupted: True" in proc.stdout
