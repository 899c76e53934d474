"""Rank-side code of the veomni 0.1.12 client tests (2 gloo ranks, real torch FSDP2 + DCP).

A bf16 ``fully_shard`` model, veomni's own ``build_optimizer`` (AdamW, or its Muon: a
``MultiOptimizer`` of ``DistributedMuon`` + AdamW), wrapped by ``MainParamsOptimizer``: 4 steps
straight must equal 2 steps, ``save_checkpoint``, a fresh build, ``load_checkpoint`` and 2 steps,
bit for bit (losses, bf16 params, fp32 main params, optimizer state). veomni's own
``DistributedCheckpointer`` refuses the wrapper before writing or loading anything (patch
``veomni_dcp_refuse_main_params``) and keeps its behaviour for every other optimizer.
"""
from __future__ import annotations

import os

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
    """Every param, fp32 main param and optimizer-state tensor, gathered, keyed by FQN."""
    if isinstance(opt, MainParamsOptimizer):
        sd = opt.state_dict()
    else:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
        sd = get_optimizer_state_dict(model, opt)
    tensors = {f"param.{n}": full(p) for n, p in model.named_parameters()}
    tensors.update({f"main.{n}": full(t) for n, t in sd.get(MP_KEY, {}).get(MAIN_PARAMS_KEY, {}).items()})
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


PATCH = "veomni_dcp_refuse_main_params"


def _veomni_checkpointer(world: int):
    """veomni's DistributedCheckpointer on CPU gloo ranks; the plugin is active (torch autoload)."""
    from veomni.checkpoint.dcp_checkpointer import DistributedCheckpointer
    from veomni.distributed.parallel_state import init_parallel_state
    init_parallel_state(dp_size=world, dp_shard_size=world, dp_mode="fsdp2", device_type="cpu")
    if not hasattr(torch.cpu, "empty_cache"):
        # veomni's execute_save calls torch.<device>.empty_cache() after dcp.save, and torch has
        # none for CPU (veomni/utils/device.py empty_cache): a no-op stands in on CPU ranks only
        torch.cpu.empty_cache = lambda: None
    return DistributedCheckpointer


def _patch_state() -> tuple:
    import npu_fsdp_patches
    from veomni.checkpoint.dcp_checkpointer import DistributedCheckpointer
    state = {r["name"]: r["state"] for r in npu_fsdp_patches.status()}.get(PATCH)
    return state, getattr(DistributedCheckpointer.save, "__npu_fsdp_patch__", None)


def _error_of(call) -> str | None:
    try:
        call()
    except Exception as exc:   # the test compares the error text
        return f"{type(exc).__name__}: {exc}"
    return None


def _files(path: str) -> list:
    """(relative path, size, mtime) of every file and folder under ``path``: any write shows."""
    entries = [os.path.join(d, n) for d, dirs, files in os.walk(path) for n in dirs + files]
    return sorted((os.path.relpath(e, path), os.stat(e).st_size, os.stat(e).st_mtime_ns)
                  for e in entries)


def _mismatched(a: dict, b: dict) -> dict:
    if set(a) != set(b):
        return {"keys": sorted(set(a) ^ set(b))}
    return {k: n for k in a if (n := bit_mismatches(a[k], b[k])[0])}


def refuses_main_params(rank: int, world: int, root: str) -> dict:
    """veomni's save and load refuse a MainParamsOptimizer before touching disk or state; after
    revert the original path is back (the KeyError, with the checkpoint dir already written)."""
    import npu_fsdp_patches
    checkpointer = _veomni_checkpointer(world)
    out = {"patch": _patch_state()}
    model, opt = build("adamw", world)
    train(model, opt, range(1), rank, world)

    target = f"{root}/veomni_dcp"
    out["save_error"] = _error_of(lambda: checkpointer.save(
        target, {"model": model, "optimizer": opt, "extra_state": {"global_step": 1}}, global_steps=1))
    dist.barrier()
    out["save_wrote"] = os.path.exists(target)

    ours = f"{root}/ours"
    save_checkpoint(ours, model, opt)          # a real DCP checkpoint of this model, at step 1
    train(model, opt, range(1, 2), rank, world)  # so a load that went ahead would change the state
    dist.barrier()
    files, before, extra = _files(ours), snapshot(model, opt), {}
    state = {"model": model, "optimizer": opt, "extra_state": extra}
    out["load_error"] = _error_of(lambda: checkpointer.load(ours, state))
    dist.barrier()
    out["load_changed"] = _mismatched(before, snapshot(model, opt))
    out["load_compared"] = len(before)
    out["load_touched_files"] = files != _files(ours)
    out["state_untouched"] = (state == {"model": model, "optimizer": opt, "extra_state": {}}
                              and state["extra_state"] is extra)

    npu_fsdp_patches.revert(PATCH)
    out["reverted"] = _patch_state()
    reverted_target = f"{root}/reverted"
    out["reverted_error"] = _error_of(lambda: checkpointer.save(
        reverted_target, {"model": model, "optimizer": opt, "extra_state": {"global_step": 2}}))
    dist.barrier()
    out["reverted_wrote"] = _files(reverted_target) if os.path.exists(reverted_target) else None
    npu_fsdp_patches.apply(PATCH)
    out["reapplied"] = _patch_state()
    out["reapplied_error"] = _error_of(lambda: checkpointer.save(
        f"{root}/reapplied", {"model": model, "optimizer": opt}))
    out["fqns"] = [n for n, _ in model.named_parameters()]
    return out


def plain_optimizer_untouched(rank: int, world: int, root: str) -> dict:
    """A plain veomni AdamW (no wrapper) saves and loads through the patched checkpointer exactly
    as through veomni's original: same checkpoint keys, extra_state and loaded tensors, bit for bit."""
    import npu_fsdp_patches
    from torch.distributed.checkpoint import FileSystemReader
    checkpointer = _veomni_checkpointer(world)
    model, opt = build("adamw", world, wrap=False)
    train(model, opt, range(2), rank, world)
    saved = snapshot(model, opt)
    runs = {}
    for mode in ("patched", "reverted"):
        if mode == "reverted":
            npu_fsdp_patches.revert(PATCH)
        path = f"{root}/{mode}"
        patch = _patch_state()
        checkpointer.save(path, {"model": model, "optimizer": opt, "extra_state": {"global_step": 2}})
        fresh_model, fresh_opt = build("adamw", world, wrap=False)
        state = {"model": fresh_model, "optimizer": fresh_opt, "extra_state": {}}
        checkpointer.load(path, state)   # veomni replaces state["extra_state"] with the saved one
        groups = [{k: v for k, v in g.items() if k != "params"} for g in fresh_opt.param_groups]
        runs[mode] = {"patch": patch, "tensors": snapshot(fresh_model, fresh_opt),
                      "extra": state["extra_state"],
                      "groups": repr(groups),
                      "keys": sorted(FileSystemReader(path).read_metadata().state_dict_metadata)}
    npu_fsdp_patches.apply(PATCH)
    patched, reverted = runs["patched"], runs["reverted"]
    control = {k: v.clone() for k, v in patched["tensors"].items()}
    first = control["state.q_proj.weight.exp_avg"].view(-1)
    first[0] = torch.nextafter(first[0], torch.tensor(float("inf"), dtype=first.dtype))   # bf16 ulp
    return {"patch": (patched["patch"], reverted["patch"]),
            "vs_saved": _mismatched(saved, patched["tensors"]),
            "vs_original": _mismatched(reverted["tensors"], patched["tensors"]),
            "compared": len(saved),
            "same_keys": patched["keys"] == reverted["keys"], "keys": len(patched["keys"]),
            "same_extra": patched["extra"] == reverted["extra"] == {"global_step": 2},
            "same_groups": patched["groups"] == reverted["groups"],
            "control": _mismatched(saved, control)}
