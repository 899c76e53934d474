"""Check ``foreach_adamw``: ``foreach_adamw_step`` bitwise against ``AdamW(foreach=True)`` on FSDP2.

Two identical FSDP2-sharded models (bf16, then fp32) get the same grads for 50 steps; the reference
steps with torch's ``AdamW(foreach=True)`` (what FSDP2 runs on its local shards), the candidate with
``foreach_adamw_step``. Params and both moments are compared bit for bit after every step.
"""
from __future__ import annotations

import torch

from npu_fsdp_patches.optim import foreach_adamw_step

from .context import Context
from .fsdp_model import set_dtensor_grads, sharded_copies

NAME = "foreach_adamw"
ORDER = 40
STEPS = 50
HYPER = {"lr": 1e-3, "weight_decay": 0.01}


def run(ctx: Context) -> dict:
    cmp = ctx.comparison()
    for dtype in (torch.bfloat16, torch.float32):
        reference, candidate = sharded_copies(ctx, dtype, 2)
        ref_opt = torch.optim.AdamW(reference, foreach=True, **HYPER)
        opt = torch.optim.AdamW(candidate, **HYPER)
        label = str(dtype).replace("torch.", "")
        for step in range(1, STEPS + 1):
            set_dtensor_grads(ctx, step, reference)
            set_dtensor_grads(ctx, step, candidate)
            ref_opt.step()
            foreach_adamw_step(opt)
            for i, (r, c) in enumerate(zip(reference, candidate)):
                cmp.exact(f"{label} step {step} param {i}", r.to_local(), c.to_local())
                for key in ("exp_avg", "exp_avg_sq"):
                    cmp.exact(f"{label} step {step} {key} {i}", ref_opt.state[r][key].to_local(),
                              opt.state[c][key].to_local())
    return cmp.result(tolerance="bitwise", steps=STEPS)
