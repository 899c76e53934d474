"""Check ``hyper_skip_dispatch``: torch AdamW on hyper-parallel DTensors under SkipDTensorDispatch.

The ``self_test`` declared in patches/hp_skip_dispatch.py, so it runs only where hyper-parallel is
installed and the plugin enabled that patch. A torch FSDP2 model is the reference (stock ``AdamW``,
as FSDP2 users run it); the candidate holds the same local shards as hyper-parallel DTensors and
steps the same ``AdamW`` inside hyper's ``SkipDTensorDispatch``. Params and moments must agree bit
for bit after every step (bf16, fp32).
"""
from __future__ import annotations

import importlib

import torch

from .context import Context
from .fsdp_model import set_dtensor_grads, sharded_copies

STEPS = 20
HYPER = {"lr": 1e-3, "weight_decay": 0.01}
#: where each hyper-parallel generation defines its placements
PLACEMENT_MODULES = ("hyper_parallel.core.dtensor.placement_types", "hyper_parallel.core.placement_types")


def _hyper_shard():
    for module in PLACEMENT_MODULES:
        try:
            return importlib.import_module(module).Shard
        except ImportError:
            continue
    raise ImportError(f"hyper-parallel has no Shard placement in {', '.join(PLACEMENT_MODULES)}")


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a (hyper or torch) DTensor; a plain tensor as is."""
    return t.to_local() if hasattr(t, "to_local") else t


def run(ctx: Context) -> dict:
    import hyper_parallel as hp  # pylint: disable=import-outside-toplevel
    import torch.optim.adam  # noqa: F401  pylint: disable=import-outside-toplevel  (the patch target)
    state = ctx.patch_state()
    if state != "applied":
        return {"skipped": f"patch {ctx.patch} is {state}"}
    shard = _hyper_shard()
    hmesh = hp.init_device_mesh(ctx.device.type, (ctx.world,))
    cmp = ctx.comparison()
    for dtype in (torch.bfloat16, torch.float32):
        (reference,) = sharded_copies(ctx, dtype, 1)
        candidate = [hp.DTensor.from_local(p.to_local().detach().clone().requires_grad_(), hmesh, (shard(0),))
                     for p in reference]
        ref_opt = torch.optim.AdamW(reference, **HYPER)
        opt = torch.optim.AdamW(candidate, **HYPER)
        label = str(dtype).replace("torch.", "")
        for step in range(1, STEPS + 1):
            chunks = set_dtensor_grads(ctx, step, reference)
            for p, chunk in zip(candidate, chunks):
                p.grad = hp.DTensor.from_local(chunk.clone(), hmesh, (shard(0),))
            ref_opt.step()
            with hp.SkipDTensorDispatch():
                opt.step()
            for i, (r, c) in enumerate(zip(reference, candidate)):
                cmp.exact(f"{label} step {step} param {i}", r.to_local(), c.to_local())
                for key in ("exp_avg", "exp_avg_sq"):
                    cmp.exact(f"{label} step {step} {key} {i}", ref_opt.state[r][key].to_local(),
                              _local(opt.state[c][key]))
    return cmp.result(tolerance="bitwise", steps=STEPS)
