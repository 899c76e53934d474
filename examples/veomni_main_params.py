"""veomni's own ``build_optimizer`` under ``MainParamsOptimizer``, resumed by veomni's own checkpointer.

    torchrun --nproc_per_node=2 examples/veomni_main_params.py [--device cpu|cuda|npu]
                                                               [--optimizer adamw|muon] [--ckpt DIR]

Needs veomni (0.1.4 or later; CI installs 0.1.12 with the pins of .ci/steps/40-veomni.sh) and numpy in the
environment where npu_fsdp_patches is installed; without either the example exits 2 at once and says
which. No patch is needed for veomni. The model is sharded with torch FSDP2 (bf16 params, fp32 gradient reduction),
cast to bf16 with ``apply_model_init_dtype``, and veomni's optimizer (AdamW, or Muon:
``DistributedMuon`` + AdamW) is wrapped. It trains 4 steps; a second run trains 2, saves with veomni's
``DistributedCheckpointer`` (``extra_state`` included), resumes into a fresh model and optimizer with
its ``load`` and trains 2 more. The checkpointer goes through torch's get/set_optimizer_state_dict,
which the wrapper serves: model params in ``param_groups``, each fp32 main param in
``state[p]["main_param"]`` (docs/main_params.md).

The check: the resumed run equals the uninterrupted one bit for bit (losses, every param and every
fp32 main param) and ``extra_state`` came back. Exits 1 otherwise.
"""
import argparse

import npu_fsdp_patches

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from device_setup import add_device_argument, checkpoint_dir, finish, init_distributed, require, require_numpy
from npu_fsdp_patches.optim import MainParamsOptimizer, apply_model_init_dtype

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


def checkpointer(device):
    """veomni's DistributedCheckpointer. Its save calls ``torch.<device>.empty_cache()``
    (veomni/utils/device.py), which CPU torch lacks: a no-op stands in on CPU only."""
    from veomni.checkpoint.dcp_checkpointer import DistributedCheckpointer
    if device.type == "cpu" and not hasattr(torch.cpu, "empty_cache"):
        torch.cpu.empty_cache = lambda: None
    return DistributedCheckpointer


def veomni_resume(path: str, model, opt, device) -> dict:
    """Load veomni's checkpoint at ``path`` into ``model``/``opt``; returns the loaded extra_state."""
    state = {"model": model, "optimizer": opt, "extra_state": {}}
    checkpointer(device).load(path, state)
    return state["extra_state"]


def gathered(model, opt) -> list:
    """Every param and its fp32 main param, gathered to full tensors."""
    return [t.full_tensor() for p in model.parameters() for t in (p, opt.main_param(p))]


def patch_line() -> str:
    applied = [r["name"] for r in npu_fsdp_patches.status() if r["state"] == "applied"]
    return (f"npu_fsdp_patches.status(): applied: {', '.join(applied) or 'none'}; no patch is needed "
            "for veomni (its checkpointer works through torch's state-dict API)")


def main() -> None:
    parser = argparse.ArgumentParser()
    add_device_argument(parser)
    parser.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw")
    parser.add_argument("--ckpt", default=None)
    args = parser.parse_args()
    require_numpy("veomni_main_params.py")
    require("veomni_main_params.py", "veomni", "0.1.4 or later: its build_optimizer and checkpointer",
            "install it with the Install block of docs/integrations/veomni.md (veomni==0.1.12, "
            "transformers==5.18.0 without its deps, no torchvision)")
    device = init_distributed(args.device)
    from veomni.distributed.parallel_state import init_parallel_state
    world = dist.get_world_size()
    init_parallel_state(dp_size=world, dp_shard_size=world, dp_mode="fsdp2", device_type=device.type)
    mesh = init_device_mesh(device.type, (world,))
    ckpt = checkpoint_dir(args.ckpt, "veomni_main_params")

    model, opt = build(args.optimizer, mesh, device)
    straight = train(model, opt, range(4), device)
    final = gathered(model, opt)

    model, opt = build(args.optimizer, mesh, device)
    first = train(model, opt, range(2), device)
    extra = {"global_step": 2, "rank": dist.get_rank()}
    checkpointer(device).save(ckpt, {"model": model, "optimizer": opt, "extra_state": extra})
    model, opt = build(args.optimizer, mesh, device)
    loaded = veomni_resume(ckpt, model, opt, device)
    carries = all("main_param" in opt.state[p] for p in model.parameters())
    resumed = first + train(model, opt, range(2, 4), device)
    same = resumed == straight and all(torch.equal(a, b) for a, b in zip(final, gathered(model, opt)))
    if dist.get_rank() == 0:
        leaves = sorted(type(leaf).__name__ for leaf in opt.leaf_optimizers)
        print(f"veomni build_optimizer({args.optimizer}) -> {' + '.join(leaves)}, wrapped in "
              f"MainParamsOptimizer on {device.type}")
        print(patch_line())
        print(f"MainParamsOptimizer state carries main_param for every param: {carries}")
        print(f"losses: {' '.join(f'{x:.4f}' for x in straight)}")
        print(f"veomni DistributedCheckpointer resume matches uninterrupted: {same}; "
              f"extra_state restored: {loaded == extra}")
    failures = [what for what, bad in (
        ("the resumed run differs from the uninterrupted one", not same),
        ("extra_state did not come back", loaded != extra),
        ("the optimizer state lacks main_param", not carries)) if bad]
    finish(not failures, "; ".join(failures))


if __name__ == "__main__":
    main()
