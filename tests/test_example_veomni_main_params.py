"""examples/veomni_main_params.py on 2 CPU ranks with veomni 0.1.12 (CI step 40-veomni; skips elsewhere).

veomni's own build_optimizer (AdamW and Muon) under MainParamsOptimizer resumes bit for bit through
save_checkpoint/load_checkpoint, and veomni's DistributedCheckpointer refuses the wrapper (patch
veomni_dcp_refuse_main_params); with that patch disabled the example's check fails (exit 1)."""
import re

import pytest

from tests.clients.veomni_env import require_veomni
from tests.example_runner import VIEW_WARNING, failure_report, run_example


@pytest.mark.parametrize("optimizer, leaves", [("adamw", "AdamW"), ("muon", "AdamW + DistributedMuon")])
def test_veomni_example_resumes_exactly_and_veomni_refuses_the_wrapper(tmp_path, optimizer, leaves):
    require_veomni()
    proc = run_example("veomni_main_params.py", "--optimizer", optimizer, "--ckpt", str(tmp_path))
    assert proc.returncode == 0, failure_report(proc)
    out = proc.stdout
    assert f"veomni build_optimizer({optimizer}) -> {leaves}, wrapped in MainParamsOptimizer on cpu" in out
    assert ("veomni_dcp_refuse_main_params: applied; veomni DistributedCheckpointer.save: refused "
            "(veomni DistributedCheckpointer.save cannot checkpoint the optimizer") in out, out
    assert "load branch: main_params; resume matches uninterrupted: True" in out, out
    assert VIEW_WARNING not in proc.stderr, proc.stderr[-3000:]


def test_veomni_example_fails_without_the_refusal(tmp_path):
    require_veomni()
    proc = run_example("veomni_main_params.py", "--ckpt", str(tmp_path),
                       env={"NPU_FSDP_PATCHES_DISABLE": "veomni_dcp_refuse_main_params"})
    assert proc.returncode == 1, failure_report(proc)
    assert re.search(r"veomni_dcp_refuse_main_params: disabled; veomni DistributedCheckpointer.save: "
                     r"failed after writing [1-9]\d* file\(s\): KeyError", proc.stdout), proc.stdout
    assert "FAILED: veomni's DistributedCheckpointer did not refuse the wrapper" in proc.stderr
