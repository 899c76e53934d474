"""Rank side of te_fused_adam_empty_group_step on TE's real FusedAdam (NVIDIA/TransformerEngine#1986).

A Megatron-Core distributed-optimizer-shaped run: each data-parallel rank's TE ``FusedAdam`` holds only
its shard of the params, as flat fp32 slices, in Megatron's two param groups (weight decay, and
``no_weight_decay`` norms). ``LAYOUT`` is what Megatron-Core's own code makes of ``MODEL``
(``megatron_layout``: ``_get_param_groups``, ``_ParamAndGradBuffer``'s padded layout and
``DistributedOptimizer._build_gbuf_range_map`` / ``_build_optimizer_group_ranges``; checked against
megatron-core 0.16.1 and 0.19.2 by tests/test_megatron_empty_group_step.py and
tests/clients/test_megatron_py312.py): at 2 ranks the ``no_weight_decay`` group is empty on rank 1 only.

``resume_case`` trains ``STEPS`` steps on 2 gloo ranks, saves each rank's ``FusedAdam.state_dict()``
(TE's own: ``param_groups`` carry ``step``) and resumes from the saved files at 2 ranks (each its own
file), at 3 ranks (``param_groups`` from rank 0's file, the common-state convention) and at 1 rank
(from each rank's file, as a rank that loads a peer's state would). Every resumed rank reports its
counters after the load and after one more step, and whether its params then equal, bit for bit, a
one-rank reference trained ``STEPS + 1`` steps. The 3- and 1-rank resumes need no collective (a
distributed optimizer's inner step is local), so each process plays its share of those ranks.
"""
from __future__ import annotations

import math
import os
import traceback

import torch
import torch.distributed as dist

import npu_fsdp_patches

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.999), 1e-8, 0.1
STEPS = 3
#: the model Megatron's layout is computed for: nn.Sequential(Linear(16, 16, bias=False),
#: Linear(16, 20, bias=False), LayerNorm(20)), as (name, shape) in module order
MODEL = (("0.weight", (16, 16)), ("1.weight", (20, 16)), ("2.weight", (20,)), ("2.bias", (20,)))
#: Megatron's param groups of MODEL: (wd_mult, names); 1-D params go to the no_weight_decay group
GROUPS = ((1.0, ("0.weight", "1.weight")), (0.0, ("2.weight", "2.bias")))
#: world -> rank -> per group, the (name, start, end) slices of the flattened params the rank's FusedAdam holds
LAYOUT = {
    1: [[[("1.weight", 0, 320), ("0.weight", 0, 256)], [("2.bias", 0, 20), ("2.weight", 0, 20)]]],
    2: [[[("1.weight", 0, 256)], [("2.bias", 0, 20), ("2.weight", 0, 20)]],
        [[("1.weight", 256, 320), ("0.weight", 0, 256)], []]],
    3: [[[("1.weight", 0, 128)], [("2.bias", 0, 20), ("2.weight", 0, 20)]],
        [[("1.weight", 128, 320), ("0.weight", 0, 64)], []],
        [[("0.weight", 64, 256)], []]],
}


def _fused_adam():
    from transformer_engine.pytorch.optimizers import FusedAdam
    return FusedAdam


def initial_params() -> dict:
    gen = torch.Generator().manual_seed(3)
    return {name: torch.randn(math.prod(shape), generator=gen) for name, shape in MODEL}


def full_grads(step: int) -> dict:
    gen = torch.Generator().manual_seed(300 + step)
    return {name: torch.randn(math.prod(shape), generator=gen) for name, shape in MODEL}


def build(slices, fulls: dict, make=None):
    """A FusedAdam over one rank's shard (``slices``: per group, (name, start, end)), as Megatron's
    DistributedOptimizer hands it to TE: plain fp32 shard tensors, one group per Megatron group, each
    with ``weight_decay = WD * wd_mult`` (what Megatron's OptimizerParamScheduler sets)."""
    groups = [{"params": [fulls[n][s:e].clone() for n, s, e in group], "weight_decay": WD * wd_mult}
              for (wd_mult, _), group in zip(GROUPS, slices)]
    if make is not None:
        return make(groups)
    return _fused_adam()(groups, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)


def set_grads(opt, slices, step: int) -> None:
    grads = full_grads(step)
    for group, spec in zip(opt.param_groups, slices):
        for p, (n, s, e) in zip(group["params"], spec):
            p.grad = grads[n][s:e].clone()


def counters(opt) -> list:
    return [g.get("step") for g in opt.param_groups]


def _assemble(saved: list, key: str) -> dict:
    """Full flat tensors of every param from the saved ranks' slices: the params, or one moment."""
    out = {name: torch.full((math.prod(shape),), float("nan")) for name, shape in MODEL}
    for file in saved:
        flat = [(n, s, e) for group in file["slices"] for n, s, e in group]
        for index, (n, s, e) in enumerate(flat):
            out[n][s:e] = file["params"][index] if key == "params" else file["state_dict"]["state"][index][key]
    return out


def _resume(saved: list, source: int, slices, reference: dict, make=None) -> dict:
    """One resumed rank: its shard of the saved params and moments, the ``param_groups`` of saved rank
    ``source``; its counters after the load and after one more step, and whether it then matches."""
    params, m, v = _assemble(saved, "params"), _assemble(saved, "exp_avg"), _assemble(saved, "exp_avg_sq")
    opt = build(slices, params, make)
    groups, state, index = [], {}, 0
    for saved_group, spec in zip(saved[source]["state_dict"]["param_groups"], slices):
        groups.append({**saved_group, "params": list(range(index, index + len(spec)))})
        for n, s, e in spec:
            state[index] = {"exp_avg": m[n][s:e].clone(), "exp_avg_sq": v[n][s:e].clone()}
            index += 1
    opt.load_state_dict({"state": state, "param_groups": groups})
    loaded = counters(opt)
    set_grads(opt, slices, STEPS)
    opt.step()
    flat = [(p, n, s, e) for group, spec in zip(opt.param_groups, slices)
            for p, (n, s, e) in zip(group["params"], spec)]
    same = all(torch.equal(p.view(torch.int32), reference[n][s:e].view(torch.int32)) for p, n, s, e in flat)
    return {"after_load": loaded, "after_step": counters(opt), "matches_reference": same,
            "holds": [len(spec) for spec in slices]}


def reference() -> dict:
    """One rank holding everything, trained STEPS + 1 steps without a checkpoint."""
    slices = LAYOUT[1][0]
    opt = build(slices, initial_params())
    for step in range(STEPS + 1):
        set_grads(opt, slices, step)
        opt.step()
    flat = [(p, n) for group, spec in zip(opt.param_groups, slices) for p, (n, _, _) in zip(group["params"], spec)]
    return {n: p.detach().clone() for p, n in flat}


def _plays(world: int, rank: int, size: int) -> list:
    """The ranks of a ``size``-rank resume this process plays."""
    return [r for r in range(size) if r % world == rank]


def resume_case(rank: int, world: int, ckpt: str, layout: dict | None = None, make=None) -> dict:
    """The train / save / resume run at ``world`` = 2 (see the module docstring); per resumed rank, its
    counters and whether it matches the one-rank reference."""
    layout = layout or LAYOUT
    out: dict = {"error": None}
    try:
        slices = layout[world][rank]
        opt = build(slices, initial_params(), make)
        for step in range(STEPS):
            set_grads(opt, slices, step)
            opt.step()
        out["before_save"] = counters(opt)
        torch.save({"slices": slices, "params": [p.detach() for g in opt.param_groups for p in g["params"]],
                    "state_dict": opt.state_dict()}, os.path.join(ckpt, f"rank{rank}.pt"))
    except Exception as exc:   # reported: the pytest side knows what each release shows
        out["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-3)}"
    dist.barrier()
    if out["error"]:
        return out
    saved = [torch.load(os.path.join(ckpt, f"rank{r}.pt"), weights_only=False) for r in range(world)]
    ref = reference()
    out["resumed"] = {f"{size}:{r}": _resume(saved, r if size == world else 0, layout[size][r], ref, make)
                      for size in (world, 3) for r in _plays(world, rank, size)}
    out["resumed"][f"1:from{rank}"] = _resume(saved, rank, layout[1][0], ref, make)
    return out


def dtensor_case(rank: int, world: int) -> dict:
    """A DTensor optimizer with a group that has no params (a frozen tower's group): its counter."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    try:
        p = torch.nn.Parameter(distribute_tensor(torch.ones(5), mesh, [Shard(0)]))
        opt = _fused_adam()([{"params": [p]}, {"params": []}], lr=LR)
        for _ in range(2):
            p.grad = distribute_tensor(torch.ones(5), mesh, [Shard(0)])
            opt.step()
    except Exception as exc:   # reported (TE's own DTensor path of an old release may not run)
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"error": None, "counters": counters(opt)}


def _describe(value):
    if isinstance(value, torch.Tensor):
        return [type(value).__name__, str(value.dtype), value.device.type, value.tolist()]
    return [type(value).__name__, value]


def exactness_case() -> dict:
    """Counters TE 2.19's rule gives, to compare release by release with the real 2.20.2: empty groups
    around a group with params (3 steps), and a capturable optimizer of empty groups (no kernel runs)."""
    FusedAdam = _fused_adam()
    out = {}
    p = torch.nn.Parameter(torch.ones(3))
    opt = FusedAdam([{"params": []}, {"params": [p]}, {"params": []}], lr=LR)
    for _ in range(3):
        p.grad = torch.ones(3)
        opt.step()
    out["plain"] = [_describe(c) for c in counters(opt)]
    try:
        opt = FusedAdam([{"params": []}, {"params": []}], lr=LR, capturable=True)
        for _ in range(2):
            opt.step()
        out["capturable"] = [_describe(c) for c in counters(opt)]
    except Exception as exc:   # a release whose capturable constructor cannot run here
        out["capturable"] = f"{type(exc).__name__}: {exc}"
    return out


def reverted_hooks_case() -> dict:
    """An optimizer built while the patch is applied, stepped after ``revert()`` and again after ``apply()``:
    its hooks follow the patch's state (the counter of its empty group)."""
    FusedAdam = _fused_adam()
    opt = FusedAdam([{"params": [torch.nn.Parameter(torch.ones(2))]}, {"params": []}], lr=LR)
    seen = []
    for phase in ("applied", "reverted", "applied again"):
        if phase == "reverted":
            npu_fsdp_patches.revert("te_fused_adam_empty_group_step")
        elif phase == "applied again":
            npu_fsdp_patches.apply("te_fused_adam_empty_group_step")
        opt.param_groups[0]["params"][0].grad = torch.ones(2)
        opt.step()
        seen.append(counters(opt))
    return {"counters": seen}


def _cases(rank: int, world: int, ckpt: str) -> dict:
    os.makedirs(ckpt, exist_ok=True)
    return {"resume": resume_case(rank, world, ckpt), "dtensor": dtensor_case(rank, world),
            "exactness": exactness_case()}


def counter_cases(rank: int, world: int, ckpt: str) -> dict:
    """Every case of this module on TE's own code (every patch reverted: the negative control), then with
    the patches the matrix applied; each run saves its checkpoint under its own folder of ``ckpt``."""
    status = {r["name"]: r["state"] for r in npu_fsdp_patches.status()}
    npu_fsdp_patches.revert()
    unpatched = _cases(rank, world, os.path.join(ckpt, "te"))
    npu_fsdp_patches.apply(*[n for n, s in status.items() if s == "applied"])
    patched = _cases(rank, world, os.path.join(ckpt, "patched"))
    if status.get("te_fused_adam_empty_group_step") == "applied":
        patched["reverted_hooks"] = reverted_hooks_case()
    return {"status": status, "unpatched": unpatched, "patched": patched}
