"""veomni's own ``build_optimizer`` under ``MainParamsOptimizer``: fp32 main params for a bf16 FSDP2 model.

    torchrun --nproc_per_node=2 examples/veomni_main_params.py [--device cpu|cuda|npu]
                                                               [--optimizer adamw|muon] [--ckpt DIR]

Needs veomni (0.1.4 or later) in the environment where npu_fsdp_patches is installed. The model is
sharded with torch FSDP2 (bf16 params, fp32 gradient reduction), cast to bf16 with
``apply_model_init_dtype``, and veomni's optimizer (AdamW, or Muon: ``DistributedMuon`` + AdamW) is
wrapped. It trains 4 steps; a second run trains 2, saves with ``save_checkpoint``, resumes into a fresh
model and optimizer with ``load_checkpoint`` and trains 2 more. veomni's own ``DistributedCheckpointer``
is handed the wrapper once, to show patch ``veomni_dcp_refuse_main_params`` refusing it up front.

The check: the resumed run equals the uninterrupted one bit for bit (losses and every param), the load
restored the fp32 main params, and veomni's checkpointer refused the wrapper. Exits 1 otherwise.
"""
import argparse
import os
import tempfile

import npu_fsdp_patches

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from device_setup import add_device_argument, finish, init_distributed
from npu_fsdp_patches.optim import (MainParamsOptimizer, apply_model_init_dtype, load_checkpoint,
                                    save_checkpoint)

PATCH = "veomni_dcp_refuse_main_params"
VOCAB, DIM, BATCH, SEQ = 11, 8, 4, 6
# what a veomni config sets: bf16 params, fp32 gradient reduction (fp32 main grads), optimizer args
MIXED_PRECISION = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
OPTIMIZER = {"lr": 1e-3, "weight_decay": 0.01}
MUON = {"lr": 0.02, "ns_implementation": "std"}


class TinyDecoder(nn.Module):
    """veomni routes by name: ``embed_tokens``/``lm_head`` to AdamW, square 2-D weights to Muon."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, DIM)
        self.q_proj = nn.Linear(DIM, DIM)
        self.o_proj = nn.Linear(DIM, DIM, bias=False)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        h = self.embed_tokens(ids.reshape(-1))      # tokens as rows: 2-D activations, no views
        return self.lm_head(h + self.o_proj(torch.tanh(self.q_proj(h))))


def build(optimizer_type: str, mesh, device):
    from veomni.optim import build_optimizer
    torch.manual_seed(1234)
    model = TinyDecoder().to(device)
    for module in (model.q_proj, model.o_proj, model):     # inner blocks first, the root last
        fully_shard(module, mesh=mesh, mp_policy=MixedPrecisionPolicy(**MIXED_PRECISION))
    apply_model_init_dtype(model, MIXED_PRECISION["param_dtype"])
    inner = build_optimizer(model, optimizer_type=optimizer_type,
                            muon_kwargs=MUON if optimizer_type == "muon" else None, **OPTIMIZER)
    return model, MainParamsOptimizer(inner, model)


def rank_batch(step: int, device) -> tuple:
    """This rank's rows of the step's global batch: (token ids, next-token targets)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(100 + step)
    ids, targets = torch.randint(0, VOCAB, (2, BATCH * world, SEQ), generator=g).unbind(0)
    rows = slice(rank * BATCH, (rank + 1) * BATCH)
    return ids[rows].to(device), targets[rows].to(device)


def train(model, opt, steps: range, device) -> list:
    """The global mean loss of each step."""
    losses = []
    for step in steps:
        ids, targets = rank_batch(step, device)
        loss = F.cross_entropy(model(ids).float(), targets.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    total = torch.stack(losses)
    dist.all_reduce(total)
    return (total / dist.get_world_size()).tolist()


def veomni_checkpointer_save(model, opt, path: str) -> tuple:
    """veomni's DistributedCheckpointer.save handed the wrapper: (refused up front, what happened)."""
    from veomni.checkpoint.dcp_checkpointer import DistributedCheckpointer
    try:
        state = {"model": model, "optimizer": opt, "extra_state": {"global_step": 2}}
        DistributedCheckpointer.save(path, state, global_steps=2)
    except TypeError as exc:
        if "cannot checkpoint the optimizer" in str(exc):     # the patch's refusal, before any write
            return True, f"refused ({str(exc).split(':')[0]})"
        return False, f"failed: TypeError: {exc}"
    except Exception as exc:      # veomni's own path: fails inside torch DCP after writing extra_state
        written = sum(len(files) for _, _, files in os.walk(path))
        return False, f"failed after writing {written} file(s): {type(exc).__name__}: {exc}"
    return False, "saved"


def main() -> None:
    parser = argparse.ArgumentParser()
    add_device_argument(parser)
    parser.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw")
    parser.add_argument("--ckpt", default=None)
    args = parser.parse_args()
    device = init_distributed(args.device)
    from veomni.distributed.parallel_state import init_parallel_state
    world = dist.get_world_size()
    init_parallel_state(dp_size=world, dp_shard_size=world, dp_mode="fsdp2", device_type=device.type)
    mesh = init_device_mesh(device.type, (world,))
    ckpt = args.ckpt or os.path.join(tempfile.gettempdir(), f"veomni_main_params_{os.getppid()}")

    model, opt = build(args.optimizer, mesh, device)
    straight = train(model, opt, range(4), device)
    params = [p.full_tensor() for p in model.parameters()]

    model, opt = build(args.optimizer, mesh, device)
    first = train(model, opt, range(2), device)
    refused, veomni_save = veomni_checkpointer_save(model, opt, os.path.join(ckpt, "veomni"))
    save_checkpoint(os.path.join(ckpt, "ours"), model, opt)
    model, opt = build(args.optimizer, mesh, device)
    branch = load_checkpoint(os.path.join(ckpt, "ours"), model, opt)
    resumed = first + train(model, opt, range(2, 4), device)
    same = resumed == straight and all(torch.equal(a, p.full_tensor())
                                       for a, p in zip(params, model.parameters()))
    patch = {r["name"]: r["state"] for r in npu_fsdp_patches.status()}.get(PATCH)
    if dist.get_rank() == 0:
        leaves = sorted(type(leaf).__name__ for leaf in opt.leaf_optimizers)
        print(f"veomni build_optimizer({args.optimizer}) -> {' + '.join(leaves)}, wrapped in "
              f"MainParamsOptimizer on {device.type}")
        print(f"losses: {' '.join(f'{x:.4f}' for x in straight)}")
        print(f"{PATCH}: {patch}; veomni DistributedCheckpointer.save: {veomni_save}")
        print(f"load branch: {branch}; resume matches uninterrupted: {same}")
    failures = [what for what, bad in (
        ("the resumed run differs from the uninterrupted one", not same),
        (f"load_checkpoint took the {branch!r} branch, not 'main_params'", branch != "main_params"),
        ("veomni's DistributedCheckpointer did not refuse the wrapper", not refused)) if bad]
    finish(not failures, "; ".join(failures))


if __name__ == "__main__":
    main()
