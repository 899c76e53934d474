"""Smoke test: examples/fsdp2_fused_adam.py under torchrun on 2 CPU ranks."""
import os
import subprocess
import sys
from pathlib import Path

from tests.torch_versions import needs_fsdp2_on_cpu

ROOT = Path(__file__).resolve().parent.parent


@needs_fsdp2_on_cpu
def test_fsdp2_fused_adam_example_trains_saves_and_resumes(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("NPU_FSDP_PATCHES")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
         str(ROOT / "examples" / "fsdp2_fused_adam.py"), "--ckpt", str(tmp_path / "ckpt")],
        cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    assert "params: DTensor torch.bfloat16; master_param: DTensor torch.float32" in out, out
    assert "resume from DCP matches uninterrupted training: True" in out, out
    first, last = (float(x) for x in out.split("loss: first ")[1].split("\n")[0].split(" -> last "))
    assert last < first, out
