"""examples/veomni_main_params.py on 2 CPU ranks with veomni 0.1.12 (CI step 40-veomni; skips elsewhere).

veomni's own build_optimizer (AdamW and Muon) under MainParamsOptimizer resumes bit for bit through
veomni's own DistributedCheckpointer, extra_state included, with no patch applied; with a resume that
loses the fp32 main params (a bug planted by tests/children/example_veomni_resume_bug.py) the
example's check fails (exit 1)."""
import pytest

from tests.clients.veomni_env import require_veomni
from tests.example_runner import VIEW_WARNING, failure_report, run_example
from tests.support import REPO_ROOT

NO_PATCH = ("npu_fsdp_patches.status(): applied: none; no patch is needed for veomni (its checkpointer "
            "works through torch's state-dict API)")


@pytest.mark.parametrize("optimizer, leaves", [("adamw", "AdamW"), ("muon", "AdamW + DistributedMuon")])
def test_veomni_example_resumes_exactly_through_veomnis_checkpointer(tmp_path, optimizer, leaves):
    require_veomni()
    # AdamW saves where --ckpt says, and keeps it; Muon saves in its own temp folder, which it removes
    # (run_example fails a run that leaves anything in its temp directory)
    ckpt = ("--ckpt", str(tmp_path)) if optimizer == "adamw" else ()
    proc = run_example("veomni_main_params.py", "--optimizer", optimizer, *ckpt)
    assert proc.returncode == 0, failure_report(proc)
    out = proc.stdout
    assert f"veomni build_optimizer({optimizer}) -> {leaves}, wrapped in MainParamsOptimizer on cpu" in out
    assert NO_PATCH in out, out
    assert "MainParamsOptimizer state carries main_param for every param: True" in out, out
    assert ("veomni DistributedCheckpointer resume matches uninterrupted: True; "
            "extra_state restored: True") in out, out
    assert (tmp_path / "extra_state").is_dir() == bool(ckpt), sorted(p.name for p in tmp_path.iterdir())
    assert VIEW_WARNING not in proc.stderr, proc.stderr[-3000:]


def test_veomni_example_fails_when_the_resume_loses_the_main_params(tmp_path):
    require_veomni()
    proc = run_example(REPO_ROOT / "tests" / "children" / "example_veomni_resume_bug.py",
                       "--ckpt", str(tmp_path))
    assert proc.returncode == 1, failure_report(proc)
    assert "veomni DistributedCheckpointer resume matches uninterrupted: False" in proc.stdout, proc.stdout
    assert "FAILED: the resumed run differs from the uninterrupted one" in proc.stderr, proc.stderr[-3000:]
