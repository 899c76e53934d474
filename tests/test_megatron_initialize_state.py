"""te_initialize_state_compat: real megatron-core 0.16.1 on TE 2.11's real FusedAdam (tests/te_real.py).

Megatron-Core's ``init_state_fn`` (``megatron/core/optimizer/__init__.py``) calls
``opt.initialize_state(p)`` with one argument; TE >= 2.1 requires two
(docs/te_fused_adam.md#22-initialize_state-call-sites).

CPU blockers, all in megatron-core 0.16.1 itself (so the callers of init_state_fn cannot run here):
* ``import megatron.core`` with TE importable needs a full TE build (``fp8_utils`` imports
  ``transformer_engine.pytorch.fp8``, ``.tensor.utils``, ... at module level). The test imports
  megatron.core with the TE site hidden, then re-executes ``megatron.core.optimizer`` unchanged
  (``importlib.reload``) with it visible, so Megatron's TE branch (``FusedAdam as Adam``) is taken.
* Precision-aware configs must set ``use_distributed_optimizer`` (``OptimizerConfig.__post_init__``),
  and ``DistributedOptimizer`` never calls ``init_state_fn`` in 0.16.1.
* Both callers need CUDA in their constructors: ``Float16OptimizerWithFloat16Params`` accepts only
  ``torch.cuda.*`` param types and ``FP32Optimizer.__init__`` does
  ``torch.tensor([1.0], device='cuda')`` (docs/te_fused_adam.md#22-initialize_state-call-sites). That
  raises ``AssertionError`` on a CPU wheel and ``RuntimeError`` on a CUDA wheel without a visible GPU
  (the registry's torch 2.6.0, 2.7.1 and 2.10.0); the child hides any GPU, so the path is the same on
  every wheel and machine.
So the test runs Megatron's own factory ``_get_megatron_optimizer_based_on_param_groups`` with a
validated precision-aware config (distributed flag cleared after validation): Megatron builds the TE
FusedAdam with its own kwargs and defines ``init_state_fn``, then stops at the CUDA tensor of
FP32Optimizer. The test takes Megatron's ``init_state_fn`` and optimizer from that frame and calls
``init_state_fn(opt, config)`` exactly as ``sharded_state_dict(is_loading=True)`` would. That driver
is shared with the megatron-core 0.19 client test: tests/multirank/megatron_py312_cases.py.
"""
import os

import pytest

from tests.support import run_case
from tests.te_real import require_te_site

pytest.importorskip("megatron.core.package_info")


def _drive(env):
    site = require_te_site("2.11.0")
    env = {"TORCH_DEVICE_BACKEND_AUTOLOAD": os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1"),
           "CUDA_VISIBLE_DEVICES": "",   # CUDA wheels too: Megatron's constructors stop at the CUDA tensor
           **env}
    result = run_case("tests.multirank.megatron_py312_cases:init_state_fn_result", paths=[site], env=env,
                      args={"te_site": str(site)}, timeout=300)
    assert result["megatron"] == "0.16.1", result["megatron"]
    assert result["master_weights"] and result["store_param_remainders"], result
    # CPU wheel: AssertionError "Torch not compiled with CUDA enabled"; CUDA wheel with no GPU
    # visible: RuntimeError "Found no NVIDIA driver ..." / "No CUDA GPUs are available"
    stop = result["factory_stop"]
    assert stop.startswith(("AssertionError", "RuntimeError")), stop
    assert any(text in stop for text in ("CUDA", "NVIDIA driver")), stop
    return result


def test_megatron_init_state_fn_fails_without_the_patch():
    result = _drive({"NPU_FSDP_PATCHES_DISABLE": "te_initialize_state_compat"})
    assert result["patch"] == "disabled"
    assert "store_param_remainders" in result["error"]


def test_megatron_init_state_fn_works_with_the_patch():
    result = _drive({})
    assert result["patch"] == "applied"
    states = result["states"]
    assert states["0.weight"] == {"exp_avg": "torch.float32", "exp_avg_sq": "torch.float32",
                                  "master_param": "torch.float32"}
    # Megatron passes store_param_remainders=True: bf16 params get TE's int16 remainder
    assert states["1.weight"]["master_param"] == "torch.int16"
