"""Train a small bf16 model with torch FSDP2 + npu_fsdp_patches.optim.FusedAdam, save, resume (DCP).

    torchrun --nproc_per_node=2 examples/fsdp2_fused_adam.py [--device cpu|cuda|npu] [--steps 6]
                                                             [--ckpt DIR]

bf16 params (FSDP2 shards them as DTensors), fp32 master weights inside the optimizer, bf16
``exp_avg_sq``. After ``steps`` steps the model and optimizer are saved with
torch.distributed.checkpoint; a fresh model + optimizer load it and train ``steps`` more. The check:
the resumed run equals the uninterrupted one bit for bit, and the loss went down. Exits 1 otherwise.
Needs numpy (torch.distributed.checkpoint calls ``Tensor.numpy()``; torch's CPU wheel does not bring
it): without it the example exits 2 at once and says so.
"""
import argparse

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from device_setup import add_device_argument, checkpoint_dir, finish, init_distributed, require_numpy
from npu_fsdp_patches.optim import FusedAdam


def build(seed: int, device: torch.device):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.GELU(),
                                torch.nn.Linear(33, 1)).to(device=device, dtype=torch.bfloat16)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.01, master_weights=True,
                    exp_avg_sq_dtype=torch.bfloat16)
    return model, opt


def train(model, opt, first: int, last: int, device: torch.device) -> float:
    loss = torch.zeros((), device=device)
    for step in range(first, last):
        gen = torch.Generator().manual_seed(1000 + step * 97 + dist.get_rank())
        x = torch.randn(8, 16, generator=gen).to(device=device, dtype=torch.bfloat16)
        y = x.float().sum(dim=1, keepdim=True) * 0.1
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser()
    add_device_argument(parser)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--ckpt", default=None)
    args = parser.parse_args()
    require_numpy("fsdp2_fused_adam.py")
    device = init_distributed(args.device)
    ckpt = checkpoint_dir(args.ckpt, "fsdp2_fused_adam")

    model, opt = build(seed=0, device=device)
    first_loss = train(model, opt, 0, 1, device)
    train(model, opt, 1, args.steps, device)
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=ckpt)
    final_loss = train(model, opt, args.steps, 2 * args.steps, device)
    reference = [p.full_tensor().float() for p in model.parameters()]

    model2, opt2 = build(seed=1, device=device)  # another init: everything must come from the checkpoint
    for p in model2.parameters():
        opt2.initialize_state(p)
    state = {"model": model2.state_dict(), "optim": opt2.state_dict()}
    dcp.load(state, checkpoint_id=ckpt)
    model2.load_state_dict(state["model"])
    opt2.load_state_dict(state["optim"])
    train(model2, opt2, args.steps, 2 * args.steps, device)
    resumed = [p.full_tensor().float() for p in model2.parameters()]
    same = all(torch.equal(a, b) for a, b in zip(resumed, reference))
    param = next(model.parameters())
    master = opt.state[param]["master_param"]
    if dist.get_rank() == 0:
        print(f"device: {device.type}; params: {type(param).__name__} {param.dtype}; "
              f"master_param: {type(master).__name__} {master.dtype}")
        print(f"loss: first {first_loss:.4f} -> last {final_loss:.4f}")
        print(f"resume from DCP matches uninterrupted training: {same}")
    finish(same and final_loss < first_loss,
           "the resumed run differs from the uninterrupted one" if not same else "the loss did not go down")


if __name__ == "__main__":
    main()
