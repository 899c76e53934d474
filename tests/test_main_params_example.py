"""examples/fsdp2_main_params_muon.py under torchrun (2 CPU ranks): resumes exactly, and its check fails
(exit 1, saying why) when the resumed run diverges."""
import re

from tests.example_runner import VIEW_WARNING, failure_report, run_example
from tests.support import REPO_ROOT
from tests.torch_versions import needs_muon


@needs_muon   # the example trains Muon + AdamW; the AdamW-only path runs in the acceptance test
def test_example_trains_saves_and_resumes(tmp_path):
    proc = run_example("fsdp2_main_params_muon.py", "--steps", "4")   # its own temp checkpoint, removed
    assert proc.returncode == 0, failure_report(proc)
    losses = [float(x) for x in re.findall(r"^step \d+ loss ([\d.]+)$", proc.stdout, re.M)]
    assert len(losses) == 4 and all(b < a for a, b in zip(losses, losses[1:]))
    assert len(re.findall(r"^resumed step \d+ loss", proc.stdout, re.M)) == 2
    assert "load branch: main_params" in proc.stdout
    assert "resume matches uninterrupted: True" in proc.stdout
    assert VIEW_WARNING not in proc.stderr, proc.stderr[-3000:]


@needs_muon
def test_example_exits_1_when_the_resumed_run_diverges(tmp_path):
    proc = run_example(REPO_ROOT / "tests" / "children" / "example_planted_resume_bug.py",
                       "--steps", "4", "--ckpt", str(tmp_path / "ckpt"))
    assert proc.returncode == 1, failure_report(proc)
    assert "resume matches uninterrupted: False" in proc.stdout, proc.stdout
    assert "FAILED: the resumed losses differ from the uninterrupted run's" in proc.stderr, proc.stderr[-3000:]
