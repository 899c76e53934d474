"""Child side of tests/test_main_params_hyper.py: run in a fresh interpreter with the hyper-parallel
stand-in site on the path (see that test module for what is checked and why)."""
import tempfile

import hyper_parallel as hp
import torch
from hyper_parallel.core.dtensor.placement_types import Replicate, Shard
from torch import nn

from npu_fsdp_patches.optim import MainParamsOptimizer, load_checkpoint, save_checkpoint
from npu_fsdp_patches.optim.tensors import local_tensor
from tests.support import bit_mismatches

MESH = hp.init_device_mesh("cpu", (1,))
gen = torch.Generator().manual_seed(0)
SPECS = {  # name: (initial local value, placements)
    "w": ((torch.rand(8, 4, generator=gen) + 0.5).to(torch.bfloat16), (Shard(0),)),
    "b": ((torch.rand(4, generator=gen) + 0.5).to(torch.bfloat16), (Replicate(),)),
    "c": (torch.rand(4, generator=gen) + 0.5, (Replicate(),)),
    "u": ((torch.rand(6, 4, generator=gen) + 0.5).to(torch.bfloat16), (Shard(0),)),
}
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


def same(a, b):
    return bit_mismatches(local_tensor(a), local_tensor(b))[0] == 0


def hyper_param(value, placements):
    local = value.clone().requires_grad_(True)
    p = hp.DTensor.from_local(local, MESH, placements)
    p._is_param = True   # what hyper's fully_shard params satisfy (docs/hyper_parallel.md#44-task-4-hyper-dtensor-api)
    return p


def build(hyper, values, adamw_kwargs):
    model = nn.Module()
    for name, (value, placements) in SPECS.items():
        value = values.get(name, value)
        setattr(model, name, hyper_param(value, placements) if hyper else nn.Parameter(value.clone()))
    groups = [{"params": [model.w, model.b, model.c]}, {"params": [model.u], "lr": 1e-2}]
    return model, MainParamsOptimizer(torch.optim.AdamW(groups, lr=1e-4, **adamw_kwargs), model)


def set_grads(model, hyper, step):
    g = torch.Generator().manual_seed(100 + step)
    for name, value, kind in (("w", SPECS["w"][0], "main"), ("b", SPECS["b"][0], "grad"),
                              ("c", SPECS["c"][0], "main"), ("u", SPECS["u"][0], "main")):
        grad = torch.randn(value.shape, generator=g) * 1e-3    # below one bf16 ulp of the params
        p = getattr(model, name)
        if kind == "grad":
            grad = grad.to(torch.bfloat16)
        if hyper:
            grad = hp.DTensor.from_local(grad, MESH, p.placements)
        setattr(p, "main_grad" if kind == "main" else "grad", grad)


def compare(hm, pm):
    bad = []
    for name in SPECS:
        hp_, pp = getattr(hm, name), getattr(pm, name)
        if not same(hp_.main_param, pp.main_param):
            bad.append(name + ".main_param")
        if not same(hp_, pp):
            bad.append(name)
        if not same(hp_, local_tensor(hp_.main_param).to(hp_.dtype)):
            bad.append(name + " != main_param.to(dtype)")
    return bad


def run(adamw_kwargs):
    out = {"mismatch": [], "alias": [], "layout": [], "zeroed": []}
    hm, ho = build(True, {}, adamw_kwargs)
    pm, po = build(False, {}, adamw_kwargs)
    for name in SPECS:
        p = getattr(hm, name)
        main = p.main_param
        if p.dtype == torch.float32:
            ok = main is p
        else:
            ok = (type(main) is type(p) and main.dtype == torch.float32
                  and isinstance(main, nn.Parameter) and main.requires_grad and main.is_leaf
                  and main.device_mesh is p.device_mesh and main.placements == p.placements
                  and tuple(main.shape) == tuple(p.shape)
                  and local_tensor(main).untyped_storage().data_ptr()
                  != local_tensor(p).untyped_storage().data_ptr()
                  and same(main, local_tensor(p).float()))
        if not ok:
            out["layout"].append(name)
    # the leaves step the main params; torch code sees the model params (docs/main_params.md)
    out["groups_hold_mains"] = ([id(q) for leaf in ho.leaf_optimizers for g in leaf.param_groups for q in g["params"]]
                                == [id(getattr(hm, n).main_param) for n in ("w", "b", "c", "u")]
                                and [id(q) for g in ho.param_groups for q in g["params"]]
                                == [id(getattr(hm, n)) for n in ("w", "b", "c", "u")])

    for step in range(3):
        set_grads(hm, True, step)
        set_grads(pm, False, step)
        if step == 1:          # prepare_grads outside the context, only the step inside
            ho.prepare_grads()
            with hp.SkipDTensorDispatch():
                ho.step_with_ready_grads()
        else:                  # hyper's trainer: the whole wrapper step inside the context
            with hp.SkipDTensorDispatch():
                ho.step()
        po.step()
        w_main_grad = local_tensor(hm.w.main_param.grad)
        out["alias"].append({
            "w_main_grad_no_copy": w_main_grad is hm.w.main_grad.to_local(),
            "w_grad_none": hm.w.grad is None,
            "b_main_grad_fp32": local_tensor(hm.b.main_param.grad).dtype == torch.float32,
            "b_grad_cleared": hm.b.grad is None,
            "c_grad_is_main_grad": local_tensor(hm.c.grad) is hm.c.main_grad.to_local(),
        })
        out["mismatch"].append(compare(hm, pm))
        set_to_none = step != 1
        ho.zero_grad(set_to_none=set_to_none)
        po.zero_grad(set_to_none=set_to_none)
        if set_to_none:
            zeroed = hm.w.main_grad is None and hm.w.main_param.grad is None and hm.b.main_param.grad is None
        else:
            # issue 42: main_grad zeroed in place; no main param keeps a grad; b's released bf16 grad comes back
            # as a zero hyper DTensor grad, as a plain optimizer leaves it (built on the local shard: no dispatch)
            zeroed = (not hm.w.main_grad.to_local().any() and hm.w.main_param.grad is None and hm.w.grad is None
                      and hm.b.main_param.grad is None and type(hm.b.grad) is type(hm.b)
                      and hm.b.grad.dtype == hm.b.dtype and not local_tensor(hm.b.grad).any())
        out["zeroed"].append(zeroed)

    # fp32 tails: bf16 cannot hold the small-lr params' main values, and their bf16 params never moved
    out["tails"] = {n: bool((local_tensor(getattr(hm, n).main_param)
                             != local_tensor(getattr(hm, n)).float()).all()) for n in ("w", "b")}
    out["small_lr_bf16_unmoved"] = all(same(getattr(hm, n), SPECS[n][0]) for n in ("w", "b"))
    out["large_lr_bf16_moved"] = not same(hm.u, SPECS["u"][0])
    # negative controls: one ulp off in one element is caught, in fp32 and in bf16
    for name, t in (("fp32", local_tensor(hm.w.main_param)), ("bf16", local_tensor(hm.w))):
        bits = t.detach().clone().view(BITS[t.dtype])
        bits.view(-1)[3] += 1
        out["ulp_caught_" + name] = not same(t, bits.view(t.dtype))

    # in-memory state dict round trip, outside the context
    sd = ho.state_dict()
    section = sd["_mixed_precision_optimizer"]["fp32_from_fp16_params"]   # their only copy (hyper DTensors)
    out["sd_keys"] = [sorted(sd["state"]), sorted(section),   # keyed by FQN, as upstream's wrapper
                      sorted(n for n, s in sd["state"].items() if "main_param" in s)]
    out["sd_section_is_mains"] = all(section[n] is getattr(hm, n).main_param for n in section)
    fresh, fo = build(True, {n: local_tensor(getattr(hm, n)).detach().clone() for n in SPECS}, adamw_kwargs)
    fo.load_state_dict(sd)
    out["loaded_mains_exact"] = all(same(getattr(fresh, n).main_param, getattr(hm, n).main_param) for n in SPECS)
    set_grads(fresh, True, 3)
    set_grads(pm, False, 3)
    with hp.SkipDTensorDispatch():
        fo.step()
    po.step()
    out["after_load_mismatch"] = compare(fresh, pm)

    # DCP does not know hyper DTensors: refused before anything is written or read
    errors = []
    ckpt = tempfile.mkdtemp()
    for call in (lambda: save_checkpoint(ckpt, hm, ho), lambda: load_checkpoint(ckpt, hm, ho)):
        try:
            call()
            errors.append(None)
        except TypeError as exc:
            errors.append(str(exc))
    out["dcp_errors"] = errors
    out["dcp_dir_empty"] = not any(__import__("os").scandir(ckpt))
    return out


def variants() -> dict:
    """Both AdamW variants: the default foreach choice and foreach=True."""
    return {"foreach_default": run({}), "foreach_true": run({"foreach": True})}


def two_leaves() -> dict:
    """Over two leaf optimizers a hyper-DTensor wrapper's state dict is upstream's multi-optimizer layout
    (flattened by FQN, main params in the section only) and loads back exactly."""
    def build2(values):
        model = nn.Module()
        for name, (value, placements) in SPECS.items():
            setattr(model, name, hyper_param(values.get(name, value), placements))
        leaves = {"first": torch.optim.AdamW([model.w, model.b, model.c], lr=1e-4),
                  "second": torch.optim.AdamW([model.u], lr=1e-2)}
        return model, MainParamsOptimizer(leaves, model)

    model, opt = build2({})
    for step in range(2):
        set_grads(model, True, step)
        with hp.SkipDTensorDispatch():
            opt.step()
    sd = opt.state_dict()
    fresh, fo = build2({n: local_tensor(getattr(model, n)).detach().clone() for n in SPECS})
    fo.load_state_dict(sd)
    moments = all(same(fo.state[getattr(fresh, n)][k], opt.state[getattr(model, n)][k])
                  for n in SPECS for k in ("exp_avg", "exp_avg_sq"))
    return {"nested": "state" in sd, "state_keys": sorted(k for k in sd if k.startswith("state.")),
            "group_lrs": {k: v for k, v in sd.items() if k.endswith(".lr")},
            "section": sorted(sd["_mixed_precision_optimizer"]["fp32_from_fp16_params"]),
            "mains_exact": all(same(getattr(fresh, n).main_param, getattr(model, n).main_param) for n in SPECS),
            "moments_exact": moments}
