"""Check ``main_params``: MainParamsOptimizer on a bf16 FSDP2 model resumes bit for bit.

A tiny bf16 language model, sharded with FSDP2, trains with fp32 main params under AdamW plus Muon
(matrix weights, when this torch has ``torch.optim.Muon``). Run one trains 4 steps, saving with
``save_checkpoint`` after step 2; run two is built afresh, loads with ``load_checkpoint`` and trains
steps 3-4. Model params, fp32 main params and every optimizer state must equal run one's bit for bit.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from npu_fsdp_patches.optim import MainParamsOptimizer, apply_model_init_dtype, load_checkpoint, save_checkpoint
from npu_fsdp_patches.optim.muon_routing import build_muon_adamw

from .compare import full
from .context import Context

NAME = "main_params"
ORDER = 30
VOCAB, DIM, BATCH_PER_RANK, SEQ = 11, 8, 2, 8
SAVE_AFTER, STEPS = 2, 4
ADAMW = {"lr": 1e-3, "weight_decay": 0.01}
MUON = {"lr": 0.02, "weight_decay": 0.0, "momentum": 0.95, "nesterov": True, "ns_steps": 5}


class TinyLM(nn.Module):
    """Embedding, two matrices with 7 rows (uneven shards), a 1-element gain (empty shard), head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.proj1 = nn.Linear(DIM, 7)
        self.proj2 = nn.Linear(7, DIM, bias=False)
        self.gain = nn.Parameter(torch.full((1,), 0.5))
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        # the FSDP2-wrapped projections take 2-D input: torch's linear with a bias on 3-D input returns a
        # view, and FSDP2 warns of every wrapped module that returns one ("returned a view tensor")
        flat = h.reshape(-1, h.shape[-1])
        mixed = self.proj2(torch.tanh(self.proj1(flat))).reshape(h.shape)
        return self.lm_head(h + mixed * self.gain)


def _build(ctx: Context):
    torch.manual_seed(1234)
    model = TinyLM().to(ctx.device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for sub in (model.proj1, model.proj2):
        fully_shard(sub, mesh=ctx.mesh, mp_policy=policy)
    fully_shard(model, mesh=ctx.mesh, mp_policy=policy)
    apply_model_init_dtype(model, torch.bfloat16)
    if hasattr(torch.optim, "Muon"):
        inner = build_muon_adamw(model, muon_kwargs=MUON, adamw_kwargs=ADAMW)
    else:
        inner = torch.optim.AdamW(model.parameters(), **ADAMW)
    return model, MainParamsOptimizer(inner, model)


def _train_step(ctx: Context, model: nn.Module, opt: MainParamsOptimizer, step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    world_batch = BATCH_PER_RANK * ctx.world
    ids = torch.randint(0, VOCAB, (world_batch, SEQ), generator=gen)
    targets = torch.randint(0, VOCAB, (world_batch, SEQ), generator=gen)
    rows = slice(ctx.rank * BATCH_PER_RANK, (ctx.rank + 1) * BATCH_PER_RANK)
    logits = model(ids[rows].to(ctx.device))
    F.cross_entropy(logits.float().reshape(-1, VOCAB), targets[rows].to(ctx.device).reshape(-1)).backward()
    opt.step()
    opt.zero_grad()


def _snapshot(model: nn.Module, opt: MainParamsOptimizer) -> dict:
    out = {f"param {n}": full(p) for n, p in model.named_parameters()}
    out.update({f"main {n}": full(p) for n, p in opt.main_params_by_fqn().items()})
    for leaf in opt.leaf_optimizers:
        for p, state in leaf.state.items():
            out.update({f"state {opt.fqn(p)}.{k}": full(v) for k, v in state.items() if torch.is_tensor(v)})
    return out


def run(ctx: Context) -> dict:
    if ctx.device.type == "cpu" and not hasattr(torch.cpu.Stream, "record_event"):
        # FSDP2 on CPU waits on a stream event that torch.cpu.Stream lacks before 2.7
        # (docs/torch_adam.md#8-fsdp2-on-cpu); device streams (npu, cuda) have it
        return {"skipped": f"FSDP2 training on CPU needs torch >= 2.7 (torch.cpu.Stream.record_event); "
                           f"this is torch {torch.__version__}"}
    checkpoint = os.path.join(ctx.workdir, NAME)
    model, opt = _build(ctx)
    for step in range(STEPS):
        if step == SAVE_AFTER:
            save_checkpoint(checkpoint, model, opt)
        _train_step(ctx, model, opt, step)
    uninterrupted = _snapshot(model, opt)
    dist.barrier()
    resumed_model, resumed_opt = _build(ctx)
    branch = load_checkpoint(checkpoint, resumed_model, resumed_opt)
    for step in range(SAVE_AFTER, STEPS):
        _train_step(ctx, resumed_model, resumed_opt, step)
    resumed = _snapshot(resumed_model, resumed_opt)
    cmp = ctx.comparison()
    for key, expected in uninterrupted.items():
        cmp.exact(key, expected, resumed.get(key, torch.empty(0)))
    leaves = sorted(type(leaf).__name__ for leaf in resumed_opt.leaf_optimizers)
    return cmp.result(tolerance="bitwise", optimizers=leaves, load_branch=branch, steps=STEPS)
