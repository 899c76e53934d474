"""Check ``te_fused_adam``: the patched TransformerEngine ``FusedAdam`` class trains on DTensors.

The ``self_test`` declared in patches/te_fused_adam.py, so it runs only where TE is installed and
the plugin enabled that patch; by then importing TE's optimizers has applied the patch (or the
plugin stood down, which the check reports). The TE class and the standalone
``npu_fsdp_patches.optim.FusedAdam`` step the same Shard(0) DTensors with the same settings (fp32;
bf16 with fp32 master weights) and must agree bit for bit.
"""
from __future__ import annotations

import torch

from npu_fsdp_patches.optim import FusedAdam

from .context import SHAPES, Context

STEPS = 5
CONFIGS = {"fp32": (torch.float32, {}),
           "bf16_fp32_master": (torch.bfloat16, {"master_weights": True, "use_decoupled_grad": True})}


def _train(ctx: Context, cls, dtype: torch.dtype, kwargs: dict) -> tuple:
    params = [torch.nn.Parameter(ctx.shard(ctx.tensor(i, shape, dtype))) for i, shape in enumerate(SHAPES)]
    opt = cls(params, lr=1e-2, weight_decay=0.1, **kwargs)
    decoupled = kwargs.get("use_decoupled_grad", False)
    for step in range(STEPS):
        for i, p in enumerate(params):
            g = ctx.grad(step, i, p.shape, torch.float32 if decoupled else dtype)
            setattr(p, "decoupled_grad" if decoupled else "grad", ctx.shard(g))
        opt.step()
    return params, opt


def run(ctx: Context) -> dict:
    from transformer_engine.pytorch.optimizers import fused_adam as te_module  # pylint: disable=import-outside-toplevel
    state = ctx.patch_state()
    if state != "applied":
        return {"skipped": f"patch {ctx.patch} is {state} after importing TE"}
    cmp = ctx.comparison()
    for label, (dtype, kwargs) in CONFIGS.items():
        te_params, te_opt = _train(ctx, te_module.FusedAdam, dtype, kwargs)
        params, opt = _train(ctx, FusedAdam, dtype, kwargs)
        for i, (t, p) in enumerate(zip(te_params, params)):
            cmp.exact(f"{label} param {i}", p.to_local(), t.to_local())
            for key, value in opt.state[p].items():
                cmp.exact(f"{label} {key} {i}", value.to_local(), te_opt.state[t][key].to_local())
    return cmp.result(tolerance="bitwise", te_class=f"{te_module.__name__}.FusedAdam")
