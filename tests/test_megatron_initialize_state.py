"""te_initialize_state_compat: real megatron-core 0.16.1 on TE 2.11's real FusedAdam (tests/te_real.py).

Megatron-Core's ``init_state_fn`` (megatron/core/optimizer/__init__.py, 0.16.1 L391-399) calls
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
  ``torch.tensor([1.0], device='cuda')`` (optimizer.py L907). That raises ``AssertionError`` on a
  CPU wheel and ``RuntimeError`` on a CUDA wheel without a visible GPU (the registry's torch 2.6.0,
  2.7.1 and 2.10.0); the child hides any GPU, so the path is the same on every wheel and machine.
So the test runs Megatron's own factory ``_get_megatron_optimizer_based_on_param_groups`` with a
validated precision-aware config (distributed flag cleared after validation): Megatron builds the TE
FusedAdam with its own kwargs and defines ``init_state_fn``, then stops at the CUDA tensor of
FP32Optimizer. The test takes Megatron's ``init_state_fn`` and optimizer from that frame and calls
``init_state_fn(opt, config)`` exactly as ``sharded_state_dict(is_loading=True)`` would.
"""
import json
import os

import pytest

from tests.support import run_python
from tests.te_real import require_te_site

pytest.importorskip("megatron.core.package_info")

_DRIVE = r"""
import importlib, json, os, sys, warnings
warnings.simplefilter("ignore")
import torch, npu_fsdp_patches
fixture = [p for p in sys.path if p == os.environ["TE_SITE"]]
saved = list(sys.path)
sys.path[:] = [p for p in sys.path if p not in fixture]
import megatron.core
sys.path[:] = saved
importlib.invalidate_caches()
import megatron.core.optimizer as mco
mco = importlib.reload(mco)
import megatron.core.package_info as info
assert info.__version__ == "0.16.1", info.__version__
assert mco.USING_PYTORCH_OPTIMIZER is False and mco.Adam.__module__.startswith("transformer_engine")

cfg = mco.OptimizerConfig(optimizer="adam", lr=1e-3, use_precision_aware_optimizer=True,
                          use_distributed_optimizer=True)
cfg.use_distributed_optimizer = False  # see the module docstring: the CPU-reachable factory branch
model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2).bfloat16())
groups = [{"params": list(model.parameters()), "wd_mult": 1.0, "lr_mult": 1.0,
           "is_expert_parallel": False, "is_decoupled_lr": False}]
try:
    mco._get_megatron_optimizer_based_on_param_groups(cfg, [model], groups)
except (AssertionError, RuntimeError) as exc:
    # CPU wheel: AssertionError "Torch not compiled with CUDA enabled"; CUDA wheel with no GPU
    # visible: RuntimeError "Found no NVIDIA driver ..." / "No CUDA GPUs are available"
    assert any(text in str(exc) for text in ("CUDA", "NVIDIA driver")), exc
    tb = exc.__traceback__
    while tb.tb_frame.f_code.co_name != "_get_megatron_optimizer_based_on_param_groups":
        tb = tb.tb_next
    frame = tb.tb_frame.f_locals
else:
    raise AssertionError("FP32Optimizer built without CUDA: drive sharded_state_dict instead")
opt, init_state_fn = frame["optimizer"], frame["init_state_fn"]
assert init_state_fn.__module__ == "megatron.core.optimizer", init_state_fn.__module__
assert type(opt) is mco.Adam and opt.store_param_remainders and opt.master_weights
result = {"patch": {r["name"]: r["state"] for r in npu_fsdp_patches.status()}["te_initialize_state_compat"]}
try:
    init_state_fn(opt, cfg)
except TypeError as exc:
    result["error"] = str(exc)
else:
    result["states"] = {n: {k: str(v.dtype) for k, v in opt.state[p].items()}
                        for n, p in model.named_parameters()}
print("RESULT" + json.dumps(result))
"""


def _drive(tmp_path, env):
    site = require_te_site("2.11.0")
    env = {"TORCH_DEVICE_BACKEND_AUTOLOAD": os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1"),
           "TE_SITE": str(site),
           "CUDA_VISIBLE_DEVICES": "",   # CUDA wheels too: Megatron's constructors stop at the CUDA tensor
           **env}
    out = run_python(_DRIVE, paths=[site], env=env, timeout=300).stdout
    return json.loads(out.split("RESULT", 1)[1])


def test_megatron_init_state_fn_fails_without_the_patch(tmp_path):
    result = _drive(tmp_path, {"NPU_FSDP_PATCHES_DISABLE": "te_initialize_state_compat"})
    assert result["patch"] == "disabled"
    assert "store_param_remainders" in result["error"]


def test_megatron_init_state_fn_works_with_the_patch(tmp_path):
    result = _drive(tmp_path, {})
    assert result["patch"] == "applied"
    states = result["states"]
    assert states["0.weight"] == {"exp_avg": "torch.float32", "exp_avg_sq": "torch.float32",
                                  "master_param": "torch.float32"}
    # Megatron passes store_param_remainders=True: bf16 params get TE's int16 remainder
    assert states["1.weight"]["master_param"] == "torch.int16"
