"""torchtitan 0.3.0 as a real client of MainParamsOptimizer and RebuildMainParamsPlanner (issue 41), 2 gloo
ranks, in CI step 46-torchtitan's venv; skips elsewhere (tests/clients/torchtitan_env.py).

examples/torchtitan_main_params.py runs as written: torchtitan's own ``OptimizersContainer`` (built from
its config) with each optimizer wrapped, saved and resumed by torchtitan's own ``CheckpointManager`` bit
for bit; a plain AdamW run's checkpoint, which that manager refuses (``Missing key ... main_param``),
resumed with fp32 masters through the planner, equal to the in-memory switch bit for bit. Its checks
fail (exit 1) on a planted bug each (tests/children/example_torchtitan_resume_bug.py). Through
torchtitan's manager the planner also refuses a partial checkpoint before writing, and any other
missing key (tests/multirank/torchtitan_cases.py).
"""
import os

import pytest

from tests.clients.torchtitan_env import require_torchtitan
from tests.distributed import run_ranks
from tests.example_runner import EXAMPLES, TORCH_OWN, VIEW_WARNING, failure_report, run_example
from tests.multirank import torchtitan_cases
from tests.support import REPO_ROOT, assert_check

BUG = REPO_ROOT / "tests" / "children" / "example_torchtitan_resume_bug.py"


def left_behind(tmp) -> list:
    """What a run left in its temp directory, besides torch's own folders."""
    return sorted(n for n in os.listdir(tmp) if not n.startswith(TORCH_OWN))


def test_example_resumes_exactly_and_moves_a_plain_run_to_fp32_masters(tmp_path):
    require_torchtitan()
    proc = run_example("torchtitan_main_params.py", env={"TMPDIR": str(tmp_path)})
    assert proc.returncode == 0, failure_report(proc)
    out = proc.stdout
    assert ("torchtitan OptimizersContainer(AdamW) -> MainParamsOptimizer per optimizer, bf16 model on cpu, "
            "2 ranks") in out, out
    assert ("npu_fsdp_patches.status(): applied: none; no patch is needed for torchtitan (its containers hold "
            "the wrapped optimizers)") in out, out
    assert "flat optimizer state carries state.<fqn>.main_param for every param: True" in out, out
    assert "CheckpointManager resume matches uninterrupted: True" in out, out
    assert ("torchtitan's CheckpointManager: refused: RuntimeError: Missing key in checkpoint state_dict: "
            "optimizer.state.tok_embeddings.weight.main_param.") in out, out
    assert ("RebuildMainParamsCheckpointManager warned: RebuildMainParamsPlanner: the checkpoint holds no fp32 "
            "main params (a plain optimizer's checkpoint): 8 main_param entries were left out") in out, out
    assert ("plain AdamW checkpoint -> fp32 masters through RebuildMainParamsPlanner: main params rebuilt from "
            "the bf16 params: True; resume matches the in-memory switch: True") in out, out
    assert VIEW_WARNING not in proc.stderr, proc.stderr[-3000:]
    assert left_behind(tmp_path) == [], "the example left its temporary folder behind"


@pytest.mark.parametrize("bug, line, failure", [
    ("loses_main_params", "CheckpointManager resume matches uninterrupted: False",
     "FAILED: the resumed run differs from the uninterrupted one"),
    ("loses_a_moment", "resume matches the in-memory switch: False",
     "FAILED: the plain checkpoint's resume differs from the in-memory switch"),
])
def test_example_fails_on_a_planted_bug(tmp_path, bug, line, failure):
    """A failed check exits 1; the folder the example made is removed, one the user named (``--ckpt``) kept."""
    require_torchtitan()
    given = ["--ckpt", str(tmp_path / "ckpt")] if bug == "loses_main_params" else []
    (tmp_path / "tmp").mkdir()
    proc = run_example(BUG, *given, env={"TESTS_PLANTED_BUG": bug, "TMPDIR": str(tmp_path / "tmp")})
    assert proc.returncode == 1, failure_report(proc)
    assert line in proc.stdout, proc.stdout
    assert failure in proc.stderr, proc.stderr[-3000:]
    assert left_behind(tmp_path / "tmp") == [], "a failed check left the temporary folder behind"
    if given:
        assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["fp32_masters", "plain_adamw"]
        assert (tmp_path / "ckpt" / "fp32_masters" / "step-2" / ".metadata").is_file()


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    require_torchtitan()
    return run_ranks("tests.multirank.torchtitan_cases:case", 2, args={"root": str(tmp_path_factory.mktemp("titan"))},
                     env={"PYTHONPATH": str(EXAMPLES)}, timeout=300)


@pytest.mark.parametrize("check", torchtitan_cases.CHECKS)
def test_planner_refusals_through_torchtitans_checkpoint_manager(refusals, check):
    assert_check(refusals, check, torchtitan_cases.CHECKS)
