"""fp32 main params for a bf16 model sharded by hyper-parallel's own fully_shard, without its trainer.

    torchrun --nproc_per_node=2 examples/hyper_parallel_main_params.py --device cpu|npu [--steps 4]

What hyper's trainer does for ``optimizer.fp32_main_params: true`` (docs/integrations/hyper_parallel.md),
in the order that works on hyper-parallel: check the config, cast the model to bf16, then hyper's
``fully_shard`` with fp32 gradient reduction into ``main_grad``, then ``MainParamsOptimizer`` over
``build_muon_adamw`` (Muon needs torch >= 2.9; older torch gets AdamW alone), stepped under
``SkipDTensorDispatch``. It checks what hyper-parallel RFC 001 2.1 asks (docs/hyper_parallel.md#5): each
bf16 param has an fp32 main param, ``main_grad`` is fp32 after backward, and after each step the model
param equals its main param cast to bf16; and that the main params keep what bf16 cannot (their fp32
tails). Exits 0 when all hold, 1 otherwise, 2 when hyper-parallel cannot be imported.

Runs on the public hyper-parallel source (gitcode mindspore/hyper-parallel, fdd0a808) on PYTHONPATH with
HYPER_PARALLEL_PLATFORM=torch. hyper needs dim 0 of every param divisible by the world size.
"""
from __future__ import annotations

import argparse

import npu_fsdp_patches  # noqa: F401  (first: hp_skip_dispatch_adamw applies to the AdamW step)
import torch
import torch.distributed as dist
from torch import nn

from device_setup import add_device_argument, finish, init_distributed, require, require_numpy
from npu_fsdp_patches.optim import (MainParamsOptimizer, apply_model_init_dtype, build_muon_adamw,
                                    validate_fp32_main_params_config)
from npu_fsdp_patches.optim.tensors import local_tensor

CONFIG = {"optimizer": {"fp32_main_params": True},
          "fsdp_config": {"mix_precision": {"reduce_dtype": "float32"}}}


def hyper_api():
    """hyper's fully_shard and MixedPrecisionPolicy: the policy moved from platform/torch/fully_shard/
    (the public source) to core/fully_shard/ (later builds; docs/hyper_parallel.md#11-generations)."""
    from hyper_parallel import SkipDTensorDispatch, init_device_mesh
    from hyper_parallel.core.fully_shard.api import fully_shard
    try:
        from hyper_parallel.core.fully_shard.utils import MixedPrecisionPolicy
    except ImportError:
        from hyper_parallel.platform.torch.fully_shard.utils import MixedPrecisionPolicy
    return SkipDTensorDispatch, init_device_mesh, fully_shard, MixedPrecisionPolicy


def build(device, world, muon):
    SkipDTensorDispatch, init_device_mesh, fully_shard, MixedPrecisionPolicy = hyper_api()
    validate_fp32_main_params_config(CONFIG)                 # before any model is built
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32, bias=False), nn.ReLU(), nn.Linear(32, 8, bias=False)).to(device)
    apply_model_init_dtype(model, "bfloat16")                # first: hyper's fully_shard records the dtype
    mesh = init_device_mesh(device_type=device.type, mesh_shape=(world,), mesh_dim_names=("dp",))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                  apply_grad_on_fp32_main_grad=True)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    kwargs = {"lr": 1e-3, "weight_decay": 0.01}
    leaves = (build_muon_adamw(model, muon_kwargs=kwargs, adamw_kwargs=kwargs) if muon
              else torch.optim.AdamW(model.parameters(), **kwargs))
    return model, MainParamsOptimizer(leaves, model), SkipDTensorDispatch


def main() -> None:
    parser = argparse.ArgumentParser()
    add_device_argument(parser)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    require_numpy("hyper_parallel_main_params.py")
    require("hyper_parallel_main_params.py", "hyper_parallel.core.fully_shard.api", "its fully_shard",
            "put a hyper-parallel source checkout on PYTHONPATH with HYPER_PARALLEL_PLATFORM=torch "
            "(docs/integrations/hyper_parallel.md)")
    device = init_distributed(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    muon = hasattr(torch.optim, "Muon")
    model, opt, SkipDTensorDispatch = build(device, world, muon)
    params = list(model.parameters())
    masters = all(p.dtype == torch.bfloat16 and opt.main_param(p).dtype == torch.float32 for p in params)
    main_grads, follow, losses = True, True, []
    gen = torch.Generator().manual_seed(rank)
    for _ in range(args.steps):
        x = torch.randn(8, 16, generator=gen).to(device, torch.bfloat16)
        loss = model(x).float().pow(2).mean()
        loss.backward()
        main_grads &= all(getattr(p, "main_grad", None) is not None and p.main_grad.dtype == torch.float32
                          for p in params)
        with SkipDTensorDispatch():                           # hyper's trainer steps here too
            opt.step()
        opt.zero_grad()
        follow &= all(torch.equal(local_tensor(p), local_tensor(opt.main_param(p)).to(torch.bfloat16))
                      for p in params)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    tails = any(not torch.equal(local_tensor(opt.main_param(p)), local_tensor(p).float()) for p in params)
    if rank == 0:
        leaves = " + ".join(sorted(type(leaf).__name__ for leaf in opt.leaf_optimizers))
        print(f"hyper-parallel fully_shard over {world} ranks on {device.type}, MainParamsOptimizer({leaves})")
        print(f"bf16 params with fp32 main params: {masters}; fp32 main_grad after backward: {main_grads}")
        print(f"model params equal their main params cast to bf16 after every step: {follow}")
        print(f"main params keep fp32 tails: {tails}")
        print(f"losses: {' '.join(f'{x:.4f}' for x in losses)}")
    failures = [what for what, bad in (
        ("a bf16 param lacks its fp32 main param", not masters), ("main_grad is not fp32", not main_grads),
        ("a model param differs from its main param cast to bf16", not follow),
        ("the main params hold nothing beyond bf16", not tails)) if bad]
    finish(not failures, "; ".join(failures))


if __name__ == "__main__":
    main()
