"""examples/fsdp2_vs_foreach_adamw.py under torchrun (2 CPU ranks) reports 0 mismatches."""
import re

from tests.example_runner import VIEW_WARNING, failure_report, run_example
from tests.torch_versions import needs_fsdp2_on_cpu


@needs_fsdp2_on_cpu
def test_example_reports_zero_mismatches():
    proc = run_example("fsdp2_vs_foreach_adamw.py")
    assert proc.returncode == 0, failure_report(proc)
    assert re.search(r"50 steps, 2 ranks: mismatches=0\b", proc.stdout), proc.stdout
    control = int(re.search(r"param mismatches=(\d+)", proc.stdout).group(1))
    assert control > 0, proc.stdout
    assert VIEW_WARNING not in proc.stderr, proc.stderr[-3000:]
