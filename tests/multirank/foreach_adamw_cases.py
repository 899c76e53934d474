"""Rank-side cases for the foreach_adamw_step contract (docs/design.md#44-hp_skip_dispatch_adamw, issue 5 item 3).

Reference: real torch FSDP2 (``fully_shard``) params stepped by ``torch.optim.AdamW(foreach=True)``.
Candidates, stepped by ``foreach_adamw_step`` on the same local shards with the same grads:
  * ``torch_dtensor``: a second FSDP2 model;
  * ``plain``: plain tensors holding the local shards;
  * ``hyper``: hyper-parallel stand-in DTensors over the local shards (when a fixture site is given).
Every step compares params, exp_avg and exp_avg_sq bitwise. The negative control runs fp32 math then
``.to(param dtype)`` on the same data and must differ.
"""
from __future__ import annotations

import copy
import math
import sys

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

from npu_fsdp_patches.optim import foreach_adamw_step
from tests.support import bit_mismatches

#: (name, global shape): uneven (7 and 5 rows on 2 ranks) and empty (1 row: nothing on rank 1) shards
SHAPES = [("w_even", (16, 8)), ("w_uneven", (7,)), ("w_empty", (1,)), ("w_uneven2d", (5, 3))]
GROUPS = [  # two param groups with different hyperparameters, weight decay on
    {"names": ["w_even", "w_uneven"], "lr": 1e-3, "weight_decay": 0.01},
    {"names": ["w_empty", "w_uneven2d"], "lr": 3e-4, "weight_decay": 0.1, "betas": (0.8, 0.95)},
]
STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
CONFIGS = {
    "adamw": {"cls": "AdamW", "kwargs": {}},
    "adam_l2_amsgrad_maximize": {"cls": "Adam", "kwargs": {"amsgrad": True, "maximize": True}},
}


class Net(nn.Module):
    def __init__(self, dtype: torch.dtype):
        super().__init__()
        gen = torch.Generator().manual_seed(1234)
        for name, shape in SHAPES:
            # magnitudes from 1e-3 to 1, so bf16 ulps of the params differ widely
            mag = torch.pow(10.0, -3 * torch.rand(shape, generator=gen))
            sign = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0)
            self.register_parameter(name, nn.Parameter((mag * sign).to(dtype)))


def full_grad(step: int, index: int, shape, dtype: torch.dtype) -> torch.Tensor:
    """Grads from far below one bf16 ulp of the param (1e-10) up to O(1), identical on every rank."""
    gen = torch.Generator().manual_seed(10_000 * step + index)
    mag = torch.pow(10.0, -10 * torch.rand(shape, generator=gen))
    sign = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0)
    return (mag * sign).to(dtype)


def local_chunk(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's dim-0 chunk as FSDP2 / DTensor Shard(0) cut it (torch.chunk; empty past the end)."""
    chunks = torch.chunk(full, world, dim=0)
    return chunks[rank].clone() if rank < len(chunks) else full[0:0].clone()


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _optimizer(cls_name: str, kwargs: dict, params_by_name: dict, foreach):
    cls = getattr(torch.optim, cls_name)
    groups = [{**{k: v for k, v in g.items() if k != "names"}, "params": [params_by_name[n] for n in g["names"]]}
              for g in GROUPS]
    return cls(groups, foreach=foreach, **kwargs)


def _fp32_then_round_step(opt: torch.optim.Optimizer) -> None:
    """Negative control: the same AdamW maths in fp32, rounded back with ``.to(dtype)`` at the end."""
    for group in opt.param_groups:
        beta1, beta2 = group["betas"]
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        for p in group["params"]:
            state = opt.state[p]
            if not state:
                state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
            state["step"] += 1
            p32, g32 = p.detach().float(), p.grad.float()
            m32, v32 = state["exp_avg"].float(), state["exp_avg_sq"].float()
            p32.mul_(1 - lr * wd)
            m32.lerp_(g32, 1 - beta1)
            v32.mul_(beta2).addcmul_(g32, g32, value=1 - beta2)
            denom = (v32.sqrt() / math.sqrt(1 - beta2 ** state["step"])).add_(eps)
            p32.addcdiv_(m32, denom, value=-lr / (1 - beta1 ** state["step"]))
            with torch.no_grad():
                p.copy_(p32.to(p.dtype))
            state["exp_avg"].copy_(m32.to(p.dtype))
            state["exp_avg_sq"].copy_(v32.to(p.dtype))


def _hyper_api(hyper_site):
    if hyper_site is None:
        return None
    if hyper_site not in sys.path:
        sys.path.insert(0, hyper_site)
    import hyper_parallel
    from hyper_parallel.core.dtensor.placement_types import Shard as HShard
    return hyper_parallel, HShard


def run_contract(rank: int, world: int, dtype: torch.dtype, config: str, steps: int, hyper_site=None,
                 negative_control: bool = False) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    base = Net(dtype)
    ref_model, cand_model = copy.deepcopy(base), copy.deepcopy(base)
    fully_shard(ref_model, mesh=mesh)
    fully_shard(cand_model, mesh=mesh)
    names = [n for n, _ in SHAPES]
    ref = dict(ref_model.named_parameters())
    cfg = CONFIGS[config]
    candidates = {"torch_dtensor": dict(cand_model.named_parameters()),
                  "plain": {n: ref[n].to_local().detach().clone().requires_grad_() for n in names}}
    api = _hyper_api(hyper_site)
    if api is not None:
        hp, hshard = api
        hmesh = hp.init_device_mesh("cpu", (world,))
        candidates["hyper"] = {n: hp.DTensor.from_local(ref[n].to_local().detach().clone().requires_grad_(),
                                                        hmesh, (hshard(0),)) for n in names}
    ref_opt = _optimizer(cfg["cls"], cfg["kwargs"], ref, foreach=True)
    opts = {k: _optimizer(cfg["cls"], cfg["kwargs"], v, foreach=None) for k, v in candidates.items()}
    control = None
    if negative_control:
        control = {n: ref[n].to_local().detach().clone() for n in names}
        control_opt = _optimizer("AdamW", {}, control, foreach=False)
    counts = {k: dict.fromkeys(("param",) + STATE_KEYS, 0) for k in candidates}
    control_count, first, first_control = 0, None, None
    for step in range(1, steps + 1):
        for index, name in enumerate(names):
            full = full_grad(step, index, ref[name].shape, dtype)
            local = local_chunk(full, rank, world)
            assert local.shape == ref[name].to_local().shape, (name, local.shape)
            ref[name].grad = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                                shape=ref[name].shape, stride=ref[name].stride())
            cand = candidates["torch_dtensor"][name]
            cand.grad = DTensor.from_local(local.clone(), mesh, [Shard(0)], run_check=False,
                                           shape=cand.shape, stride=cand.stride())
            candidates["plain"][name].grad = local.clone()
            if "hyper" in candidates:
                candidates["hyper"][name].grad = hp.DTensor.from_local(local.clone(), hmesh, (hshard(0),))
            if control is not None:
                control[name].grad = local.clone()
        ref_opt.step()
        for opt in opts.values():
            foreach_adamw_step(opt)
        if control is not None:
            _fp32_then_round_step(control_opt)
        for kind, params in candidates.items():
            for name in names:
                ref_state, state = ref_opt.state[ref[name]], opts[kind].state[params[name]]
                pairs = [("param", ref[name], params[name])]
                pairs += [(key, ref_state[key], state[key]) for key in STATE_KEYS if key in ref_state]
                for what, a, b in pairs:
                    n, where = bit_mismatches(_local(a).detach(), _local(b).detach())
                    counts[kind][what] += n
                    if n and first is None:
                        first = f"step {step} {kind} {name}.{what}: {where}"
        if control is not None:
            for name in names:
                n, where = bit_mismatches(ref[name].to_local().detach(), control[name].detach())
                control_count += n
                if n and first_control is None:
                    first_control = f"step {step} {name}: {where}"
    state_types = {kind: sorted({type(v).__name__ for p in params.values() for v in opts[kind].state[p].values()})
                   for kind, params in candidates.items()}
    steps_ok = all(int(ref_opt.state[ref[n]]["step"]) == steps for n in names)
    return {"counts": counts, "first": first, "control": control_count, "first_control": first_control,
            "steps_ok": steps_ok, "state_types": state_types, "elements": sum(ref[n].to_local().numel() for n in names)}


def one_ulp_detected(rank: int, world: int) -> dict:
    """The comparator sees a single element moved by one ulp (bf16 and fp32)."""
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        a = torch.linspace(-1, 1, 9, dtype=dtype)
        b = a.clone()
        b[4] = torch.nextafter(b[4].float(), torch.tensor(2.0)).to(dtype) if dtype == torch.float32 else \
            (b[4:5].view(torch.int16) + 1).view(dtype)[0]
        out[str(dtype)] = bit_mismatches(a, b)[0]
    return out


def grad_layout_error(rank: int, world: int) -> str:
    """A Shard(0) param with a Replicate grad of the same global shape: local shapes differ."""
    mesh = init_device_mesh("cpu", (world,))
    param = nn.Parameter(DTensor.from_local(torch.zeros(2), mesh, [Shard(0)]))
    param.grad = DTensor.from_local(torch.ones(4), mesh, [Replicate()])
    try:
        foreach_adamw_step(torch.optim.AdamW([param]))
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def contract(rank: int, world: int, hyper_site=None, steps: int = 50) -> dict:
    """Everything of item 3 in one launch."""
    return {
        "bf16": run_contract(rank, world, torch.bfloat16, "adamw", steps, hyper_site, negative_control=True),
        "fp32": run_contract(rank, world, torch.float32, "adamw", steps, hyper_site),
        "bf16_adam_l2_amsgrad_maximize": run_contract(rank, world, torch.bfloat16, "adam_l2_amsgrad_maximize",
                                                      10, hyper_site),
        "one_ulp": one_ulp_detected(rank, world),
        "grad_layout_error": grad_layout_error(rank, world),
    }
