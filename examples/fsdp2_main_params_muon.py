"""Train a bf16 model with Muon + AdamW on fp32 main params under torch FSDP2, save, resume.

    torchrun --nproc_per_node=2 examples/fsdp2_main_params_muon.py [--device cpu|cuda|npu]
                                                                   [--steps 4] [--ckpt DIR]

Follows RFC 001's build order (docs/hyper_parallel.md#rfc-001-6-model-dtype): validate the config,
build and shard the model, cast it to model_init_dtype, build Muon (2-D weights) + AdamW (embeddings, head,
biases), wrap them in MainParamsOptimizer. It saves after half the steps, resumes into a fresh model and
optimizer. The check: the load restored the fp32 main params ("main_params"), the resumed losses equal
the uninterrupted run's, and the loss went down. Exits 1 otherwise. Needs torch.optim.Muon (torch >= 2.9)
and numpy (for the checkpoint; without it the example exits 2 at once and says so).
"""
import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from device_setup import add_device_argument, checkpoint_dir, finish, init_distributed, require_numpy
from npu_fsdp_patches.optim import (MainParamsOptimizer, apply_model_init_dtype, build_muon_adamw,
                                    load_checkpoint, save_checkpoint, validate_fp32_main_params_config)

CONFIG = {
    "model_init_dtype": "bfloat16",
    "optimizer": {"fp32_main_params": True,
                  "muon_config": {"lr": 0.02, "weight_decay": 0.0, "momentum": 0.95, "nesterov": True},
                  "adamw_config": {"lr": 1e-3, "weight_decay": 0.01}},
    "fsdp_config": {"mix_precision": {"param_dtype": "bfloat16", "reduce_dtype": "float32"}},
}
VOCAB, DIM = 32, 16


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
                                    for _ in range(2))
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        # Tokens as rows of 2-D activations: nn.Linear on a 3-D input returns a view, and FSDP2 warns
        # about a view returned from a sharded module (an in-place op on it would skip its hooks).
        h = self.embed(ids.reshape(-1))
        for block in self.blocks:
            h = h + block(h)
        return self.lm_head(h)      # (tokens, VOCAB)


def build(mesh, device):
    torch.manual_seed(0)
    model = TinyLM().to(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    apply_model_init_dtype(model, CONFIG["model_init_dtype"])
    chain = build_muon_adamw(model, muon_kwargs=CONFIG["optimizer"]["muon_config"],
                             adamw_kwargs=CONFIG["optimizer"]["adamw_config"])
    return model, MainParamsOptimizer(chain, model)


def train_step(model, opt, rank, world, device):
    g = torch.Generator().manual_seed(0)   # one fixed batch: the loss must go down
    ids = torch.randint(0, VOCAB, (4 * world, 8), generator=g)[rank * 4:(rank + 1) * 4].to(device)
    logits = model(ids[:, :-1]).float()
    loss = F.cross_entropy(logits, ids[:, 1:].reshape(-1))
    loss.backward()
    opt.prepare_grads()
    torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 1.0)
    opt.step_with_ready_grads()
    opt.zero_grad()
    loss = loss.detach()
    dist.all_reduce(loss)
    return loss.item() / world


def main():
    parser = argparse.ArgumentParser()
    add_device_argument(parser)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--ckpt", default=None)
    args = parser.parse_args()
    require_numpy("fsdp2_main_params_muon.py")
    validate_fp32_main_params_config(CONFIG)      # fails before any model is built
    device = init_distributed(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    ckpt = checkpoint_dir(args.ckpt, "fsdp2_main_params_muon")
    half = args.steps // 2

    model, opt = build(mesh, device)
    losses = []
    for step in range(args.steps):
        if step == half:
            save_checkpoint(ckpt, model, opt)
        losses.append(train_step(model, opt, rank, world, device))
        if rank == 0:
            print(f"step {step} loss {losses[-1]:.6f}", flush=True)

    model2, opt2 = build(mesh, device)
    branch = load_checkpoint(ckpt, model2, opt2)
    resumed = [train_step(model2, opt2, rank, world, device) for _ in range(half, args.steps)]
    if rank == 0:
        for step, loss in zip(range(half, args.steps), resumed):
            print(f"resumed step {step} loss {loss:.6f}", flush=True)
        print(f"load branch: {branch}")
        print(f"resume matches uninterrupted: {resumed == losses[half:]}")
    failures = [what for what, bad in (
        (f"load_checkpoint took the {branch!r} branch, not 'main_params'", branch != "main_params"),
        ("the resumed losses differ from the uninterrupted run's", resumed != losses[half:]),
        ("the loss did not go down", not losses[-1] < losses[0])) if bad]
    finish(not failures, "; ".join(failures))


if __name__ == "__main__":
    main()
