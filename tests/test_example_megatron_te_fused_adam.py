"""examples/megatron_te_fused_adam.py on 2 CPU ranks: Megatron-Core 0.16.1's factory builds TE 2.11's
real FusedAdam (tests/te_real.py) on FSDP2 DTensor params; with the plugin its states are DTensors and
its steps match torch AdamW; without te_fused_adam_dtensor TE 2.11 keeps plain global-shape states
(docs/te_fused_adam.md#14-dtensor-handling) and the example's check fails (exit 1)."""
import re

import pytest

from tests.example_runner import VIEW_WARNING, failure_report, run_example
from tests.support import REPO_ROOT
from tests.te_real import require_te_site
from tests.torch_versions import needs_fsdp2_on_cpu

pytest.importorskip("megatron.core.package_info")
SCRIPT = REPO_ROOT / "tests" / "children" / "megatron_te_example_on_cpu.py"


def _run(env=None):
    site = require_te_site("2.11.0")
    return run_example(SCRIPT, paths=[site],
                       env={"CUDA_VISIBLE_DEVICES": "", "TE_SITE": str(site), **(env or {})})


@needs_fsdp2_on_cpu
def test_megatron_te_example_matches_torch_adamw():
    proc = _run()
    assert proc.returncode == 0, failure_report(proc)
    out = proc.stdout
    assert ("optimizer: FP32Optimizer(transformer_engine.pytorch.optimizers.fused_adam.FusedAdam)"
            in out), out
    assert "params: DTensor torch.float32; exp_avg: DTensor" in out, out
    assert re.search(r"patches: .*te_fused_adam_dtensor applied", out), out
    assert re.search(r"te_initialize_state_compat applied", out), out
    assert "states laid out like their params: True" in out, out
    assert "matches torch AdamW on the same DTensors: True" in out, out
    assert VIEW_WARNING not in proc.stderr, proc.stderr[-3000:]


@needs_fsdp2_on_cpu
def test_megatron_te_example_fails_without_the_patch():
    proc = _run({"NPU_FSDP_PATCHES_DISABLE": "te_fused_adam_dtensor"})
    assert proc.returncode == 1, failure_report(proc)
    assert "te_fused_adam_dtensor disabled" in proc.stdout, proc.stdout
    assert "states laid out like their params: False" in proc.stdout, proc.stdout     # TE 2.11's global-shape states
    assert "FAILED: optimizer states are not laid out like their DTensor params" in proc.stderr
