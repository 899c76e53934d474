"""Check ``fused_adam``: standalone FusedAdam on Shard(0) DTensors against full tensors, plus DCP.

Every rank steps the sharded params and a full-tensor copy of them with the same FusedAdam settings
on its device and compares the gathered result within the stated tolerance (fp32 params; bf16 params
with fp32 master weights, whose masters are compared too). Then it saves model and optimizer with DCP
at this world size, reloads them into a fresh optimizer, takes more steps on both, and requires the
two to agree bit for bit.
"""
from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint as dcp

from npu_fsdp_patches.optim import FusedAdam

from .compare import Comparison, full
from .context import SHAPES, Context

NAME = "fused_adam"
ORDER = 20
STEPS, RESUME_STEPS = 5, 2
TOLERANCE = {"rtol": 1e-6, "atol": 1e-7}
CONFIGS = {"fp32": (torch.float32, {}),
           "bf16_fp32_master": (torch.bfloat16, {"master_weights": True, "use_decoupled_grad": True})}
HYPER = {"lr": 1e-2, "weight_decay": 0.1}


def _params(ctx: Context, dtype: torch.dtype, sharded: bool) -> list:
    fulls = [ctx.tensor(i, shape, dtype) for i, shape in enumerate(SHAPES)]
    if not sharded:
        return [torch.nn.Parameter(f) for f in fulls]
    return [torch.nn.Parameter(ctx.shard(f)) for f in fulls]


def _step(ctx: Context, params: list, opt: FusedAdam, step: int, decoupled: bool) -> None:
    for i, p in enumerate(params):
        g = ctx.grad(step, i, p.shape, torch.float32 if decoupled else p.dtype)
        if hasattr(p, "device_mesh"):
            g = ctx.shard(g)
        setattr(p, "decoupled_grad" if decoupled else "grad", g)
    opt.step()


def run(ctx: Context) -> dict:
    cmp = ctx.comparison()
    for label, (dtype, kwargs) in CONFIGS.items():
        decoupled = kwargs.get("use_decoupled_grad", False)
        sharded, reference = _params(ctx, dtype, True), _params(ctx, dtype, False)
        opt, ref_opt = FusedAdam(sharded, **HYPER, **kwargs), FusedAdam(reference, **HYPER, **kwargs)
        for step in range(STEPS):
            _step(ctx, sharded, opt, step, decoupled)
            _step(ctx, reference, ref_opt, step, decoupled)
        for i, (p, r) in enumerate(zip(sharded, reference)):
            tol = TOLERANCE if dtype == torch.float32 else {"rtol": 2.0 ** -7, "atol": 1e-7}
            cmp.close(f"{label} param {i}", r.detach(), full(p), **tol)
            if kwargs.get("master_weights"):
                cmp.close(f"{label} master {i}", ref_opt.state[r]["master_param"],
                          full(opt.state[p]["master_param"]), **TOLERANCE)
        _dcp_round_trip(ctx, cmp, label, sharded, opt, kwargs)
    return cmp.result(tolerance={"fp32": TOLERANCE, "bf16 params": {"rtol": 2.0 ** -7, "atol": 1e-7},
                                 "dcp": "bitwise"})


def _dcp_round_trip(ctx: Context, cmp: Comparison, label: str, params: list, opt: FusedAdam,
                    kwargs: dict) -> None:
    """Save, continue (the reference); reload into a fresh optimizer, continue; compare bitwise."""
    decoupled = kwargs.get("use_decoupled_grad", False)
    checkpoint = os.path.join(ctx.workdir, f"{NAME}_{label}")
    dcp.save({"model": {f"p{i}": p for i, p in enumerate(params)}, "optim": opt.state_dict()}, checkpoint_id=checkpoint)
    loaded = _params(ctx, params[0].dtype, True)
    loaded_opt = FusedAdam(loaded, **HYPER, **kwargs)
    for p in loaded:
        loaded_opt.initialize_state(p)
    template = {"model": {f"p{i}": p for i, p in enumerate(loaded)}, "optim": loaded_opt.state_dict()}
    dcp.load(template, checkpoint_id=checkpoint)
    loaded_opt.load_state_dict(template["optim"])
    for step in range(STEPS, STEPS + RESUME_STEPS):
        _step(ctx, params, opt, step, decoupled)
        _step(ctx, loaded, loaded_opt, step, decoupled)
    for i, (p, q) in enumerate(zip(params, loaded)):
        cmp.exact(f"{label} dcp param {i}", full(p), full(q))
        for key, value in opt.state[p].items():
            cmp.exact(f"{label} dcp {key} {i}", full(value), full(loaded_opt.state[q][key]))
