"""Rank-side code of the veomni 0.1.12 client tests (2 gloo ranks, real torch FSDP2 + DCP).

A bf16 ``fully_shard`` model, veomni's own ``build_optimizer`` (AdamW, or its Muon: a
``MultiOptimizer`` of ``DistributedMuon`` + AdamW), wrapped by ``MainParamsOptimizer``: 4 steps
straight must equal 2 steps, a checkpoint, a fresh build, a load and 2 steps, bit for bit (losses,
bf16 params, fp32 main params, optimizer state), through ``save_checkpoint``/``load_checkpoint``
and through veomni's own ``DistributedCheckpointer`` (``extra_state`` included).
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


def build(optimizer_type: str, world: int, wrap: bool = True):
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
    return model, (MainParamsOptimizer(inner, model) if wrap else inner)


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
    """Every param and optimizer-state tensor (fp32 main params included), gathered, by FQN."""
    tensors = {f"param.{n}": full(p) for n, p in model.named_parameters()}
    for p, state in opt.state.items():
        fqn = opt.fqn(p)
        tensors.update({f"state.{fqn}.{k}": full(v) for k, v in state.items() if torch.is_tensor(v)})
    return tensors


def _veomni_checkpointer(world: int):
    """veomni's DistributedCheckpointer on CPU gloo ranks (the plugin is active: torch autoload)."""
    from veomni.checkpoint.dcp_checkpointer import DistributedCheckpointer
    if not hasattr(torch.cpu, "empty_cache"):
        # veomni's execute_save calls torch.<device>.empty_cache() after dcp.save, and torch has
        # none for CPU (veomni/utils/device.py empty_cache): a no-op stands in on CPU ranks only
        torch.cpu.empty_cache = lambda: None
    return DistributedCheckpointer


def _compare(straight: dict, resumed: dict) -> dict:
    assert set(straight) == set(resumed), sorted(set(straight) ^ set(resumed))
    return {k: n for k in straight if (n := bit_mismatches(straight[k], resumed[k])[0])}


def train_and_resume(rank: int, world: int, optimizer_type: str, root: str) -> dict:
    """4 steps straight vs 2 steps, checkpoint, fresh build, load, 2 steps: through our
    save_checkpoint/load_checkpoint and through veomni's own DistributedCheckpointer."""
    from veomni.distributed.parallel_state import init_parallel_state
    init_parallel_state(dp_size=world, dp_shard_size=world, dp_mode="fsdp2", device_type="cpu")
    checkpointer = _veomni_checkpointer(world)
    model, opt = build(optimizer_type, world)
    leaves = sorted(type(leaf).__name__ for leaf in opt.leaf_optimizers)
    straight_losses = train(model, opt, range(4), rank, world)
    straight = snapshot(model, opt)
    out = {"leaves": leaves, "compared": len(straight)}

    for route in ("ours", "veomni"):
        model, opt = build(optimizer_type, world)
        first_losses = train(model, opt, range(2), rank, world)
        path = f"{root}/{optimizer_type}-{route}"
        if route == "ours":
            save_checkpoint(path, model, opt)
            model, opt = build(optimizer_type, world)
            out["branch"] = load_checkpoint(path, model, opt)
        else:
            extra = {"global_step": 2, "rank": rank}
            checkpointer.save(path, {"model": model, "optimizer": opt, "extra_state": extra})
            model, opt = build(optimizer_type, world)
            state = {"model": model, "optimizer": opt, "extra_state": {}}
            checkpointer.load(path, state)
            out["extra_state"] = state["extra_state"]
        resumed_losses = first_losses + train(model, opt, range(2, 4), rank, world)
        resumed = snapshot(model, opt)
        out[route] = {"mismatched": _compare(straight, resumed),
                      "same_losses": straight_losses == resumed_losses}
    control = resumed["state.q_proj.weight.main_param"].clone()
    control.view(-1)[0] = torch.nextafter(control.view(-1)[0], torch.tensor(float("inf")))
    out["control_mismatches"] = bit_mismatches(straight["state.q_proj.weight.main_param"], control)[0]
    out["fp32_tail_elements"] = sum(int((straight[f"state.{n}.main_param"] != straight[f"param.{n}"].float()).sum())
                                    for n, _ in model.named_parameters())
    out["local_embed_rows"] = int(opt.main_param(model.embed_tokens.weight).to_local().shape[0])
    out["local_gain_numel"] = int(opt.main_param(model.gain).to_local().numel())
    return out
