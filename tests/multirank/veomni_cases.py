"""Rank-side code of the veomni 0.1.12 client tests (2 gloo ranks, real torch FSDP2 + DCP).

A bf16 ``fully_shard`` model, veomni's own ``build_optimizer`` (AdamW, or its Muon: a
``MultiOptimizer`` of ``DistributedMuon`` + AdamW), wrapped by ``MainParamsOptimizer``: 4 steps
straight must equal 2 steps, ``save_checkpoint``, a fresh build, ``load_checkpoint`` and 2 steps,
bit for bit (losses, bf16 params, fp32 main params, optimizer state).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from npu_fsdp_patches.optim import (MainParamsOptimizer, apply_model_init_dtype, load_checkpoint,
                                    save_checkpoint)
from npu_fsdp_patches.optim.main_params import MAIN_PARAMS_KEY, MP_KEY
from tests.multirank.main_params_cases import full
from tests.support import bit_mismatches

VOCAB, DIM, BATCH, SEQ = 11, 8, 4, 6


class TinyDecoder(nn.Module):
    """veomni's routing by name: ``embed_tokens``/``lm_head`` -> AdamW, square 2-D weights -> Muon.

    11 vocab rows shard 6/5 (uneven); the 1-element ``gain`` leaves rank 1 an empty shard.
    """

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, DIM)
        self.q_proj = nn.Linear(DIM, DIM)
        self.o_proj = nn.Linear(DIM, DIM, bias=False)
        self.gain = nn.Parameter(torch.full((1,), 0.5))
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        h = self.embed_tokens(ids)
        return self.lm_head(h + self.o_proj(torch.tanh(self.q_proj(h))) * self.gain)


def build(optimizer_type: str, world: int):
    from veomni.optim import build_optimizer
    torch.manual_seed(1234)
    model = TinyDecoder()
    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for sub in (model.q_proj, model.o_proj):
        fully_shard(sub, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    apply_model_init_dtype(model, torch.bfloat16)
    muon = {"lr": 0.02, "ns_implementation": "std"} if optimizer_type == "muon" else None
    inner = build_optimizer(model, lr=1e-3, weight_decay=0.01, optimizer_type=optimizer_type,
                            muon_kwargs=muon)
    return model, MainParamsOptimizer(inner, model)


def train(model, opt, steps: range, rank: int, world: int) -> list[float]:
    losses = []
    for step in steps:
        g = torch.Generator().manual_seed(100 + step)
        ids = torch.randint(0, VOCAB, (BATCH * world, SEQ), generator=g)[rank * BATCH:(rank + 1) * BATCH]
        targets = torch.randint(0, VOCAB, (BATCH * world, SEQ), generator=g)[rank * BATCH:(rank + 1) * BATCH]
        loss = F.cross_entropy(model(ids).float().reshape(-1, VOCAB), targets.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss = loss.detach()
        dist.all_reduce(loss)
        losses.append(loss.item() / world)
    return losses


def snapshot(model, opt) -> dict:
    sd = opt.state_dict()
    tensors = {f"param.{n}": full(p) for n, p in model.named_parameters()}
    tensors.update({f"main.{n}": full(t) for n, t in sd[MP_KEY][MAIN_PARAMS_KEY].items()})
    for fqn, state in sd["state"].items():
        tensors.update({f"state.{fqn}.{k}": full(v) for k, v in state.items() if torch.is_tensor(v)})
    return tensors


def train_and_resume(rank: int, world: int, optimizer_type: str, root: str) -> dict:
    from veomni.distributed.parallel_state import init_parallel_state
    init_parallel_state(dp_size=world, dp_shard_size=world, dp_mode="fsdp2", device_type="cpu")
    model, opt = build(optimizer_type, world)
    leaves = sorted(type(leaf).__name__ for leaf in opt.leaf_optimizers)
    straight_losses = train(model, opt, range(4), rank, world)
    straight = snapshot(model, opt)

    model, opt = build(optimizer_type, world)
    first_losses = train(model, opt, range(2), rank, world)
    save_checkpoint(f"{root}/{optimizer_type}", model, opt)
    model, opt = build(optimizer_type, world)
    branch = load_checkpoint(f"{root}/{optimizer_type}", model, opt)
    resumed_losses = first_losses + train(model, opt, range(2, 4), rank, world)
    resumed = snapshot(model, opt)

    assert set(straight) == set(resumed), sorted(set(straight) ^ set(resumed))
    mismatched = {k: bit_mismatches(straight[k], resumed[k])[0] for k in straight}
    mismatched = {k: n for k, n in mismatched.items() if n}
    control = resumed["main.q_proj.weight"].clone()
    control.view(-1)[0] = torch.nextafter(control.view(-1)[0], torch.tensor(float("inf")))
    tails = sum(int((straight[f"main.{n}"] != straight[f"param.{n}"].float()).sum())
                for n, _ in model.named_parameters())
    return {"leaves": leaves, "branch": branch, "mismatched": mismatched,
            "losses": (straight_losses, resumed_losses), "compared": len(straight),
            "control_mismatches": bit_mismatches(straight["main.q_proj.weight"], control)[0],
            "fp32_tail_elements": tails,
            "local_embed_rows": int(opt.main_param(model.embed_tokens.weight).to_local().shape[0]),
            "local_gain_numel": int(opt.main_param(model.gain).to_local().numel())}


def distributed_checkpointer(rank: int, world: int, root: str) -> dict:
    """What veomni's own DistributedCheckpointer does with the wrapper (the README's documented limit)."""
    from veomni.checkpoint.dcp_checkpointer import DistributedCheckpointer
    from veomni.distributed.parallel_state import init_parallel_state
    init_parallel_state(dp_size=world, dp_shard_size=world, dp_mode="fsdp2", device_type="cpu")
    model, opt = build("adamw", world)
    train(model, opt, range(1), rank, world)
    try:
        DistributedCheckpointer.save(f"{root}/veomni_dcp", {"model": model, "optimizer": opt})
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "fqns": [n for n, _ in model.named_parameters()]}
    return {"error": None}
