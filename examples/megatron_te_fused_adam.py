"""TransformerEngine's FusedAdam, built by Megatron-Core's optimizer factory, on FSDP2 (DTensor) params.

    torchrun --nproc_per_node=2 examples/megatron_te_fused_adam.py [--device cuda|npu|cpu] [--steps 5]

A device-only template: it needs megatron-core and a TransformerEngine that imports, in the
environment where npu_fsdp_patches is installed: NVIDIA TE with its torch extension on a CUDA GPU
(``pip install transformer-engine[pytorch]``, which builds the extension against CUDA), or TE-NPU with
torch_npu on an NPU. On a CPU-only machine TE cannot be imported (the registry's
``transformer-engine`` alone is a meta package: "Found empty `transformer-engine` meta package
installed"), so the example stops at once with exit code 2 and says why. The test suite runs it on CPU
ranks only through tests/children/megatron_te_example_on_cpu.py, which puts the suite's stand-ins
(TE's real optimizer sources with CPU kernels for its CUDA extension) in TE's place. Megatron-Core's optimizer module picks TE's ``FusedAdam``
whenever TE imports; its factory (``get_megatron_optimizer`` for Megatron's own model chunks, here its
param-group builder, since the model is sharded by torch FSDP2) builds it with Megatron's arguments
and wraps it in Megatron's fp32 optimizer. The patches (``te_fused_adam_dtensor`` and, on NVIDIA TE,
``te_multi_tensor_apply_empty_tail``) make it update DTensor params on their local shards.

The check: every optimizer state is a DTensor laid out like its param (what DCP checkpoints need),
and after ``steps`` steps the params equal those of the same model trained with ``torch.optim.AdamW``
on the same DTensors (rtol 1e-5, atol 1e-6; TE's kernel and torch's differ by rounding only). Exits 1
otherwise. Prints the ``status()`` of the TE patches.
"""
import argparse
import os
import sys

import npu_fsdp_patches  # first: the patches apply when TE's optimizer module is imported

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from device_setup import add_device_argument, finish, init_distributed, require_device

LR, WD = 1e-2, 0.1
TE_PATCHES = ("te_fused_adam_dtensor", "te_multi_tensor_apply_empty_tail", "te_fused_adam_empty_scale",
              "te_initialize_state_compat")


def build_model(device: torch.device, mesh) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.GELU(), torch.nn.Linear(33, 1))
    fully_shard(model.to(device), mesh=mesh)   # 33 rows: uneven shards on 2 ranks
    return model


def megatron_te_optimizer(model: torch.nn.Module):
    """Megatron-Core's factory on the model's params: fp32 config, so FP32Optimizer(TE FusedAdam)."""
    from megatron.core.optimizer import OptimizerConfig, _get_megatron_optimizer_based_on_param_groups
    config = OptimizerConfig(optimizer="adam", lr=LR, weight_decay=WD, clip_grad=0.0)
    groups = [{"params": list(model.parameters()), "wd_mult": 1.0, "lr_mult": 1.0,
               "is_expert_parallel": False, "is_decoupled_lr": False}]
    return _get_megatron_optimizer_based_on_param_groups(config, [model], groups)


def batch(step: int, device: torch.device) -> tuple:
    gen = torch.Generator().manual_seed(100 + 7 * step + dist.get_rank())
    x = torch.randn(8, 16, generator=gen).to(device)
    return x, x.sum(dim=1, keepdim=True) * 0.1


def train(model, opt, steps: int, device: torch.device) -> float:
    """Megatron's optimizer step returns (update_successful, grad_norm, num_zeros_in_grad)."""
    losses = []
    for step in range(steps):
        x, y = batch(step, device)
        losses.append(torch.nn.functional.mse_loss(model(x), y))
        losses[-1].backward()
        result = opt.step()
        if isinstance(result, tuple) and not result[0]:
            raise RuntimeError(f"Megatron's optimizer skipped step {step}")
        opt.zero_grad()
    return losses[-1].item()


def require_te() -> None:
    """Stop with exit code 2 and the reason when TransformerEngine's optimizers cannot be imported:
    without TE, Megatron-Core silently falls back to torch's Adam and the example would test nothing."""
    try:
        import transformer_engine.pytorch.optimizers  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - TE raises RuntimeError, ImportError, FileNotFoundError ...
        if os.environ.get("RANK", "0") == "0":
            print("megatron_te_fused_adam.py needs a TransformerEngine that imports: NVIDIA TE with its torch "
                  "extension on a CUDA GPU, or TE-NPU with torch_npu on an NPU (a device-only template; "
                  f"README 'Quickstart per stack'). Importing it failed: {type(exc).__name__}: {exc}",
                  file=sys.stderr)
        sys.exit(2)


def main() -> None:
    parser = argparse.ArgumentParser()
    add_device_argument(parser)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    require_device(args.device)
    if args.device == "npu":
        import torch_npu  # noqa: F401  (TE-NPU needs it before its own import)
    require_te()
    device = init_distributed(args.device)
    if device.type == "npu":
        from torch_npu.contrib import transfer_to_npu  # noqa: F401  (Megatron allocates on "cuda")
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel()
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))

    model = build_model(device, mesh)
    opt = megatron_te_optimizer(model)
    te_adam = opt.optimizer
    loss = train(model, opt, args.steps, device)

    reference = build_model(device, mesh)
    train(reference, torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WD), args.steps, device)
    diff = max((p.full_tensor() - r.full_tensor()).abs().max().item()
               for p, r in zip(model.parameters(), reference.parameters()))
    close = all(torch.allclose(p.full_tensor(), r.full_tensor(), rtol=1e-5, atol=1e-6)
                for p, r in zip(model.parameters(), reference.parameters()))
    laid_out = all(isinstance(s, DTensor) and s.placements == p.placements and s.shape == p.shape
                   for p in model.parameters() for s in te_adam.state[p].values() if torch.is_tensor(s))
    patches = {r["name"]: r["state"] for r in npu_fsdp_patches.status() if r["name"] in TE_PATCHES}
    if dist.get_rank() == 0:
        param = next(model.parameters())
        print(f"optimizer: {type(opt).__name__}({type(te_adam).__module__}.{type(te_adam).__name__})")
        print(f"params: {type(param).__name__} {param.dtype}; "
              f"exp_avg: {type(te_adam.state[param]['exp_avg']).__name__}")
        print(f"patches: {', '.join(f'{name} {state}' for name, state in patches.items())}")
        print(f"loss after {args.steps} steps: {loss:.4f}; max abs diff vs torch AdamW: {diff:.2e}")
        print(f"states laid out like their params: {laid_out}")
        print(f"matches torch AdamW on the same DTensors: {close}")
    finish(laid_out and close, "optimizer states are not laid out like their DTensor params" if not laid_out
           else f"TE FusedAdam differs from torch AdamW by up to {diff:.2e}")


if __name__ == "__main__":
    main()
