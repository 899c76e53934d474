"""Train a small bf16 model with torch FSDP2 + npu_fsdp_patches.optim.FusedAdam, save, resume (DCP).

    torchrun --nproc_per_node=2 examples/fsdp2_fused_adam.py [--steps 6] [--ckpt DIR]

bf16 params (FSDP2 shards them as DTensors), fp32 master weights inside the optimizer, bf16
``exp_avg_sq``. After ``steps`` steps the model and optimizer are saved with
torch.distributed.checkpoint; a fresh model + optimizer load it and train ``steps`` more, and the
script checks the resumed run against the uninterrupted one. Runs on CPU (gloo) or any accelerator.
"""
import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import fully_shard

from npu_fsdp_patches.optim import FusedAdam


def build(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.GELU(),
                                torch.nn.Linear(33, 1)).to(torch.bfloat16)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.01, master_weights=True,
                    exp_avg_sq_dtype=torch.bfloat16)
    return model, opt


def train(model, opt, first: int, last: int) -> float:
    loss = torch.tensor(0.0)
    for step in range(first, last):
        gen = torch.Generator().manual_seed(1000 + step * 97 + dist.get_rank())
        x = torch.randn(8, 16, generator=gen).to(torch.bfloat16)
        y = x.float().sum(dim=1, keepdim=True).to(torch.bfloat16) * 0.1
        loss = torch.nn.functional.mse_loss(model(x).float(), y.float())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--ckpt", default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ckpt = args.ckpt or os.path.join(tempfile.gettempdir(), f"fsdp2_fused_adam_{os.getppid()}")

    model, opt = build(seed=0)
    first_loss = train(model, opt, 0, 1)
    train(model, opt, 1, args.steps)
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=ckpt)
    final_loss = train(model, opt, args.steps, 2 * args.steps)
    reference = [p.full_tensor().float() for p in model.parameters()]

    model2, opt2 = build(seed=1)  # different init: everything must come from the checkpoint
    for p in model2.parameters():
        opt2.initialize_state(p)
    state = {"model": model2.state_dict(), "optim": opt2.state_dict()}
    dcp.load(state, checkpoint_id=ckpt)
    model2.load_state_dict(state["model"])
    opt2.load_state_dict(state["optim"])
    train(model2, opt2, args.steps, 2 * args.steps)
    resumed = [p.full_tensor().float() for p in model2.parameters()]
    same = all(torch.equal(a, b) for a, b in zip(resumed, reference))
    master = opt.state[next(iter(model.parameters()))]["master_param"]
    if rank == 0:
        print(f"params: {type(next(model.parameters())).__name__} {next(model.parameters()).dtype}; "
              f"master_param: {type(master).__name__} {master.dtype}")
        print(f"loss: first {first_loss:.4f} -> last {final_loss:.4f}")
        print(f"resume from DCP matches uninterrupted training: {same}")
    dist.barrier()
    dist.destroy_process_group()
    if not same:
        print("resumed run diverged from the uninterrupted run", file=sys.stderr)
    sys.stdout.flush()  # then skip interpreter teardown, where gloo threads can abort a finished run
    os._exit(0 if same else 1)


if __name__ == "__main__":
    main()
