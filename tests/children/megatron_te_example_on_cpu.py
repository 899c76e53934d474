"""examples/megatron_te_fused_adam.py on CPU ranks with TE 2.11's real optimizer sources (the torchrun
script of tests/test_example_megatron_te_fused_adam.py; the TE site in $TE_SITE, first on PYTHONPATH).

Two CPU stand-ins, both in megatron-core 0.16.1 itself (tests/test_megatron_initialize_state.py):
* ``import megatron.core`` with TE importable needs a full TE build, so it is imported with the TE
  site hidden, and ``megatron.core.optimizer`` is then re-executed with it visible (Megatron's TE
  branch, ``FusedAdam as Adam``), by the Megatron test's own helper.
* ``FP32Optimizer.__init__`` allocates its constant loss scale with ``device='cuda'``
  (megatron/core/optimizer/optimizer.py L907); that call is sent to the CPU, as the TE site's own
  seam (tests/fixtures/te_torch_cpu ``_cpu_seam``) does for TE's overflow flag. This wrapper sits
  outside TE's, so it redirects both callers. The scale is only read by ``get_loss_scale``;
  everything else runs unchanged.
"""
import functools
import os
import runpy
import sys

import torch

from tests.example_runner import EXAMPLES
from tests.multirank.megatron_py312_cases import _megatron_optimizer_module

_CUDA_TO_CPU_CALLERS = ("megatron.core.optimizer.optimizer", "transformer_engine.pytorch.optimizers.")


def _cuda_scale_to_cpu() -> None:
    original = torch.tensor

    @functools.wraps(original)
    def tensor(*args, **kwargs):
        if (kwargs.get("device") == "cuda"
                and sys._getframe(1).f_globals.get("__name__", "").startswith(_CUDA_TO_CPU_CALLERS)):
            kwargs["device"] = "cpu"
        return original(*args, **kwargs)

    torch.tensor = tensor


if __name__ == "__main__":
    _megatron_optimizer_module(os.environ["TE_SITE"])
    _cuda_scale_to_cpu()
    runpy.run_path(str(EXAMPLES / "megatron_te_fused_adam.py"), run_name="__main__")
