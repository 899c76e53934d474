"""examples/fsdp2_fused_adam.py under torchrun on 2 CPU ranks: trains, saves, resumes exactly."""
import re

from tests.example_runner import VIEW_WARNING, failure_report, run_example
from tests.torch_versions import needs_fsdp2_on_cpu


@needs_fsdp2_on_cpu
def test_fsdp2_fused_adam_example_trains_saves_and_resumes(tmp_path):
    proc = run_example("fsdp2_fused_adam.py")   # its own temp checkpoint, removed
    assert proc.returncode == 0, failure_report(proc)
    out = proc.stdout
    assert "device: cpu; params: DTensor torch.bfloat16; master_param: DTensor torch.float32" in out, out
    assert "resume from DCP matches uninterrupted training: True" in out, out
    first, last = map(float, re.search(r"loss: first ([\d.]+) -> last ([\d.]+)", out).groups())
    assert last < first, out
    assert VIEW_WARNING not in proc.stderr, proc.stderr[-3000:]
