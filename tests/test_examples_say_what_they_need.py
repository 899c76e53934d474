"""An example whose requirement is missing exits 2 at once with one line saying what it needs (README
'Quickstart per stack'), never a rank traceback: numpy (torch's CPU wheel does not bring it; DCP needs
it) for the examples that checkpoint, veomni for veomni_main_params.py, hyper-parallel for
hyper_parallel_main_params.py, torchtitan for torchtitan_main_params.py, torch_npu for ``--device npu``
(the README's own command line), a GPU for ``--device cuda``. The check comes before the process
group, so a plain ``python`` run shows it."""
import os
import subprocess
import sys

import pytest

from tests.example_runner import EXAMPLES
from tests.support import REPO_ROOT

_HIDE = """
import sys
class _Hide:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {hidden!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)   # as when not installed
sys.meta_path.insert(0, _Hide())
"""


def run_hiding(tmp_path, script: str, *hidden: str, device: str = "cpu") -> subprocess.CompletedProcess:
    site = tmp_path / "hide"
    site.mkdir(parents=True)
    (site / "sitecustomize.py").write_text(_HIDE.format(hidden=set(hidden)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("NPU_FSDP_PATCHES")}
    env.update(PYTHONPATH=os.pathsep.join(map(str, (site, REPO_ROOT, EXAMPLES))), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(EXAMPLES / script), "--device", device], cwd=str(tmp_path),
                          env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("script, hidden, line", [
    ("fsdp2_fused_adam.py", ("numpy",),
     "fsdp2_fused_adam.py needs numpy (torch.distributed.checkpoint calls Tensor.numpy()): `pip install numpy`. "
     "Importing it failed: ModuleNotFoundError: No module named 'numpy'"),
    ("fsdp2_main_params_muon.py", ("numpy",), "fsdp2_main_params_muon.py needs numpy ("),
    ("veomni_main_params.py", ("numpy",), "veomni_main_params.py needs numpy ("),
    ("veomni_main_params.py", ("veomni",),
     "veomni_main_params.py needs veomni (0.1.4 or later: its build_optimizer and checkpointer): install it "
     "with the Install block of docs/integrations/veomni.md (veomni==0.1.12, transformers==5.18.0 without its "
     "deps, no torchvision). Importing it failed: ModuleNotFoundError: No module named 'veomni'"),
    ("hyper_parallel_main_params.py", ("hyper_parallel",),
     "hyper_parallel_main_params.py needs hyper_parallel.core.fully_shard.api (its fully_shard): put a "
     "hyper-parallel source checkout on PYTHONPATH with HYPER_PARALLEL_PLATFORM=torch "
     "(docs/integrations/hyper_parallel.md). Importing it failed: ModuleNotFoundError: "),
    ("torchtitan_main_params.py", ("numpy",), "torchtitan_main_params.py needs numpy ("),
    ("torchtitan_main_params.py", ("torchtitan",),
     "torchtitan_main_params.py needs torchtitan.components.optimizer (torchtitan 0.3.0's OptimizersContainer "
     "and CheckpointManager, on torch >= 2.10): install it as docs/integrations/torchtitan.md says, "
     "`pip install torchtitan==0.3.0`. "
     "Importing it failed: ModuleNotFoundError: No module named 'torchtitan'"),
])
def test_a_missing_requirement_is_one_line_and_exit_2(tmp_path, script, hidden, line):
    proc = run_hiding(tmp_path, script, *hidden)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr[-3000:])
    assert line in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stdout == ""


@pytest.mark.parametrize("script", ["fsdp2_fused_adam.py", "fsdp2_vs_foreach_adamw.py", "megatron_te_fused_adam.py"])
def test_a_device_this_machine_lacks_is_one_line_and_exit_2(tmp_path, script):
    proc = run_hiding(tmp_path, script, "torch_npu", device="npu")
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr[-3000:])
    assert (f"{script} needs torch_npu (--device npu: it registers the npu device and hccl): install torch_npu "
            "and source CANN's set_env.sh, or run with --device cpu. Importing it failed: ModuleNotFoundError: "
            "No module named 'torch_npu'") in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    import torch
    if torch.cuda.is_available():
        return
    proc = run_hiding(tmp_path / "cuda", script, device="cuda")
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr[-3000:])
    assert f"{script} --device cuda needs a CUDA build of torch that sees a GPU (torch " in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
