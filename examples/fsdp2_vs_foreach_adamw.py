"""torch FSDP2 AdamW vs ``foreach_adamw_step`` on the same local bf16 shards, 50 steps.

    torchrun --standalone --nproc_per_node=2 examples/fsdp2_vs_foreach_adamw.py [--device cpu|cuda|npu]

Each step a bf16 model sharded with ``fully_shard`` runs forward/backward and
``torch.optim.AdamW(foreach=True)`` (what torch FSDP2 runs on NPU/GPU). Its reduced local grads are
copied onto plain tensors that hold the same local shards, which ``foreach_adamw_step`` updates. The
script prints how many param / exp_avg / exp_avg_sq elements differ bitwise (expected: 0, else it
exits 1), and, as a counter-example, how many differ for fp32 maths followed by ``.to(bf16)``.
"""
import argparse
import math
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from device_setup import add_device_argument, finish, init_distributed
from npu_fsdp_patches.optim import foreach_adamw_step

STEPS = 50


def mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.reshape(-1).view(torch.int16) != b.reshape(-1).view(torch.int16)).sum())


@torch.no_grad()
def fp32_then_round(params, grads, state, step, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, wd=0.01):
    for p, g, (m, v) in zip(params, grads, state):
        p32, g32, m32, v32 = p.float(), g.float(), m.float(), v.float()
        p32.mul_(1 - lr * wd)
        m32.lerp_(g32, 1 - betas[0])
        v32.mul_(betas[1]).addcmul_(g32, g32, value=1 - betas[1])
        denom = (v32.sqrt() / math.sqrt(1 - betas[1] ** step)).add_(eps)
        p32.addcdiv_(m32, denom, value=-lr / (1 - betas[0] ** step))
        p.copy_(p32.to(torch.bfloat16)), m.copy_(m32.to(torch.bfloat16)), v.copy_(v32.to(torch.bfloat16))


def main() -> None:
    parser = argparse.ArgumentParser()
    add_device_argument(parser)
    device = init_distributed(parser.parse_args().device)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 7)).to(device, torch.bfloat16)
    fully_shard(model, mesh=init_device_mesh(device.type, (world,)),
                mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    reference = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, foreach=True)
    shards = [p.to_local().detach().clone().requires_grad_() for p in model.parameters()]
    candidate = torch.optim.AdamW(shards, lr=1e-3, weight_decay=0.01)
    control = [p.to_local().detach().clone() for p in model.parameters()]
    control_state = [(torch.zeros_like(p), torch.zeros_like(p)) for p in control]
    total, total_control = 0, 0
    for step in range(1, STEPS + 1):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step)).to(device, torch.bfloat16)
        model(x.chunk(world)[rank]).float().pow(2).mean().backward()
        grads = [p.grad.to_local().clone() for p in model.parameters()]
        for shard, grad in zip(shards, grads):
            shard.grad = grad
        reference.step()
        foreach_adamw_step(candidate)
        fp32_then_round(control, grads, control_state, step)
        reference.zero_grad()
        for p, shard, ctl in zip(model.parameters(), shards, control):
            ref_state, state = reference.state[p], candidate.state[shard]
            total += mismatches(p.to_local().detach(), shard.detach())
            total += sum(mismatches(ref_state[k].to_local(), state[k]) for k in ("exp_avg", "exp_avg_sq"))
            total_control += mismatches(p.to_local().detach(), ctl)
    counts = torch.tensor([total, total_control], device=device)
    dist.all_reduce(counts)
    if rank == 0:
        print(f"foreach_adamw_step vs torch FSDP2 AdamW(foreach=True), {STEPS} steps, {world} ranks: "
              f"mismatches={int(counts[0])}")
        print(f"fp32 maths then .to(bf16) (the rejected fix) vs torch FSDP2: param mismatches={int(counts[1])}")
    finish(int(counts[0]) == 0, f"foreach_adamw_step differs from torch FSDP2 in {int(counts[0])} elements")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
