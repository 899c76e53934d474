"""Rank-side cases on TE's real FusedAdam (a registry wheel's source, tests/te_real.py).

The rank runs with ``te_site(version)`` on PYTHONPATH. ``patched=False`` reverts every patch first,
so the rank runs TE's own code (the negative controls); ``patched=True`` keeps what the matrix
decided. Each config trains 5 steps on params with uneven and empty Shard(0) shards whose **last**
param is empty on every rank but rank 0 (TE#3212), and reports what happened; the pytest side
decides what each release must show.
"""
from __future__ import annotations

import traceback

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import npu_fsdp_patches
from tests.multirank.dtensors import distribute_same
from tests.multirank.fused_adam_cases import full_of, like, ref_adam

STEPS = 5
KW = dict(lr=1e-2, weight_decay=0.1)
# name -> (param dtype, grad dtype, FusedAdam kwargs, decoupled grad)
CONFIGS = {
    "fp32": (torch.float32, torch.float32, {}, False),
    "bf16_master": (torch.bfloat16, torch.float32, {"master_weights": True}, True),
    "bf16_moments": (torch.float32, torch.float32,
                     {"exp_avg_dtype": torch.bfloat16, "exp_avg_sq_dtype": torch.bfloat16}, False),
    "fp16_moments": (torch.float32, torch.float32,
                     {"exp_avg_dtype": torch.float16, "exp_avg_sq_dtype": torch.float16}, False),
    "decoupled": (torch.float32, torch.float32, {}, True),
}
# (global numel, placements): uneven on 2 and 3 ranks, then one replicated, then numel 1 last
SPECS = ((7, (Shard(0),)), (5, (Replicate(),)), (1, (Shard(0),)))


def _fulls(dtype):
    gen = torch.Generator().manual_seed(5)
    return [torch.randn(n, generator=gen).to(dtype) for n, _ in SPECS]


def _grads(step, dtype):
    gen = torch.Generator().manual_seed(50 + step)
    return [torch.randn(n, generator=gen).to(dtype) for n, _ in SPECS]


def _params(mesh, dtype, dtensor=True):
    return [torch.nn.Parameter(distribute_same(f, mesh, pl) if dtensor
                               else f.clone()) for f, (_, pl) in zip(_fulls(dtype), SPECS)]


def _set_grads(params, step, gdtype, decoupled):
    for p, g in zip(params, _grads(step, gdtype)):
        g = like(p, g)
        if decoupled:
            p.decoupled_grad = g
        else:
            p.grad = g


def _make(cls, params, config):
    _, _, kw, decoupled = CONFIGS[config]
    return cls(params, **KW, use_decoupled_grad=decoupled, **kw)


def _train(cls, params, config, steps=STEPS):
    pdtype, gdtype, _, decoupled = CONFIGS[config]
    opt = _make(cls, params, config)
    for s in range(steps):
        _set_grads(params, s, gdtype, decoupled)
        opt.step()
    return opt


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    if a.numel() == 0:
        return 0
    ai, bi = a.float().view(torch.int32).long(), b.float().view(torch.int32).long()
    return int((ai - bi).abs().max())


def _layout_ok(opt, params) -> bool:
    for p in params:
        for st in opt.state[p].values():
            if not (isinstance(st, DTensor) and st.placements == p.placements
                    and st.shape == p.shape and st.stride() == p.stride()):
                return False
    return True


def _round_trip_bitwise(cls, opt, params, config) -> bool:
    sd = opt.state_dict()
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = _make(cls, twin, config)
    opt2.load_state_dict(sd)
    sd2 = opt2.state_dict()
    for i in sd["state"]:
        for name, v in sd["state"][i].items():
            w = sd2["state"][i][name]
            if type(v) is not type(w) or not torch.equal(full_of(v), full_of(w)):
                return False
    return [g["step"] for g in opt2.param_groups] == [g["step"] for g in opt.param_groups]


def _failed(exc) -> dict:
    return {"error": f"{type(exc).__name__}: {exc}", "where": traceback.format_exc(limit=-3)}


def run_config(mesh, cls, config: str) -> dict:
    """Train locally, agree on failures across ranks, then compare (collectives only if all ran)."""
    pdtype, gdtype, _, _ = CONFIGS[config]
    out: dict = {"error": None}
    try:
        params = _params(mesh, pdtype)
        before = [p._local_tensor.clone() for p in params]
        opt = _train(cls, params, config)
        out["updated"] = [bool(p._local_tensor.numel() == 0 or not torch.equal(p._local_tensor, b))
                          for p, b in zip(params, before)]
        out["layout_ok"] = _layout_ok(opt, params)
    except Exception as exc:  # reported to the pytest side, which knows what each release shows
        out.update(_failed(exc))
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, out["error"])
    out["any_rank_failed"] = any(errors)
    if out["any_rank_failed"]:
        return out
    try:
        errs = []
        for i, (p, full) in enumerate(zip(params, _fulls(pdtype))):
            ref, _, _ = ref_adam(full.float(), [_grads(s, gdtype)[i] for s in range(STEPS)],
                                 lr=KW["lr"], wd=KW["weight_decay"])
            errs.append(float((full_of(p.detach()).double() - ref).abs().max()))
        out["max_err"] = max(errs)
        out["round_trip"] = _round_trip_bitwise(cls, opt, params, config)
    except Exception as exc:
        out.update(_failed(exc))
    return out


def dtensor_configs(rank: int, world: int, configs: list) -> dict:
    """Each config on TE's own code (every patch reverted), then with the matrix's patches."""
    from transformer_engine.pytorch.optimizers import FusedAdam
    mesh = init_device_mesh("cpu", (world,))
    status = {r["name"]: r["state"] for r in npu_fsdp_patches.status()}
    npu_fsdp_patches.revert()
    unpatched = {c: run_config(mesh, FusedAdam, c) for c in configs}
    npu_fsdp_patches.apply(*[n for n, s in status.items() if s == "applied"])
    patched = {c: run_config(mesh, FusedAdam, c) for c in configs}
    return {"status": status, "unpatched": unpatched, "patched": patched,
            "ulps_vs_te_plain": ulps_vs_te_plain(mesh, FusedAdam)}


def ulps_vs_te_plain(mesh, cls) -> int:
    """fp32 ulps between the (patched) DTensor run and TE's own plain-tensor run of the same class."""
    dt, plain = _params(mesh, torch.float32), _params(mesh, torch.float32, dtensor=False)
    _train(cls, dt, "fp32")
    _train(cls, plain, "fp32")
    return max(_ulps(full_of(a.detach()), b.detach()) for a, b in zip(dt, plain))


def plain_bitwise(rank: int, world: int, configs=tuple(CONFIGS)) -> dict:
    """Plain-tensor training with every patch applied vs reverted: bitwise, with a 1-ulp control."""
    from transformer_engine.pytorch.optimizers import FusedAdam
    out = {}
    for config in configs:
        runs = []
        for patched in (False, True):
            npu_fsdp_patches.revert() if not patched else npu_fsdp_patches.apply()
            params = _params(None, CONFIGS[config][0], dtensor=False)
            opt = _train(FusedAdam, params, config)
            runs.append(([p.detach().clone() for p in params], opt.state_dict()))
        (ref, ref_sd), (got, got_sd) = runs
        same = all(torch.equal(a, b) for a, b in zip(got, ref)) and all(
            torch.equal(got_sd["state"][k][n], v)
            for k in ref_sd["state"] for n, v in ref_sd["state"][k].items())
        nudged = ref[0].clone()  # the same values but one unit in the last place in element 0
        nudged.view(torch.int16 if nudged.element_size() == 2 else torch.int32).view(-1)[0] += 1
        out[config] = {"bitwise": same, "control_caught": not torch.equal(got[0], nudged)}
    return out


def two_ranks(rank: int, world: int, configs: list, fixes_dir: str, dcp_args: dict | None = None) -> dict:
    """A release's 2-rank launch: ``dtensor_configs`` (none for a release before DTensor support); with
    ``dcp_args`` the DCP save of tests/multirank/te_real_dcp_cases.py (under the import-time patches,
    which dtensor_configs restores); ``plain_bitwise``, which reverts and applies every patch; then the
    step-counter and FP8-moment cases (tests/multirank/te_step_counter_cases.py, te_fp8_moment_cases.py,
    each on TE's own code and patched, checkpoints under ``fixes_dir``)."""
    from tests.multirank.te_fp8_moment_cases import fp8_cases
    from tests.multirank.te_real_dcp_cases import save_and_continue
    from tests.multirank.te_step_counter_cases import counter_cases
    out = {"configs": dtensor_configs(rank, world, configs)} if configs else {}
    if dcp_args is not None:
        out["dcp"] = save_and_continue(rank, world, **dcp_args)
    out["plain"] = plain_bitwise(rank, world, configs or PLAIN_BEFORE_2_1)
    out["counter"] = counter_cases(rank, world, fixes_dir)
    out["fp8"] = fp8_cases() if rank == 0 else None
    return out


#: the configs TE 1.x's constructor takes (no bf16 moments before 2.1)
PLAIN_BEFORE_2_1 = ("fp32", "bf16_master", "fp16_moments", "decoupled")


def three_ranks(rank: int, world: int, configs: list, dcp_args: dict) -> dict:
    """A release's 3-rank launch: ``dtensor_configs``, then loading the 2-rank launch's DCP checkpoint."""
    from tests.multirank.te_real_dcp_cases import load_and_continue
    return {"configs": dtensor_configs(rank, world, configs),
            "dcp": load_and_continue(rank, world, **dcp_args)}
