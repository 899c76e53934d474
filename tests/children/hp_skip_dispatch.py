"""Child side of tests/test_hp_skip_dispatch_patch.py: one fresh interpreter per case, with the
hyper-parallel stand-in (and for ``veomni_case`` the veomni fork) on the path. Each case first calls
``_start``, which sets up the 1-rank meshes and spies on torch's Adam implementations.
"""
import torch
import torch.distributed as dist
import torch.optim.adam as A
import torch.optim.adamw as AW
import torch.optim.optimizer as O
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor as TorchDTensor
from torch.distributed.tensor import Shard as TorchShard

import npu_fsdp_patches
import hyper_parallel as hp
from hyper_parallel import SkipDTensorDispatch
from tests.support import bit_mismatches

calls = []
ACCEL = O._get_foreach_kernels_supported_devices
Shard = tmesh = hmesh = None   # set by _start


def _start(generation: str) -> dict:
    """Meshes, the generation's Shard class and the spies; returns the result dict with the record."""
    global Shard, tmesh, hmesh
    if generation == "new":
        from hyper_parallel.core.dtensor.placement_types import Shard
    else:
        from hyper_parallel.core.placement_types import Shard
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    tmesh, hmesh = init_device_mesh("cpu", (1,)), hp.init_device_mesh("cpu", (1,))
    for _mod in (A, AW):   # torch 2.6: AdamW runs its own *_adamw kernels, recorded under the Adam name
        for _name in ("_single_tensor_adam", "_multi_tensor_adam", "_fused_adam"):
            _own = _name + ("" if _mod is A else "w")
            _f = getattr(_mod, _own, None)
            if _f is None or _f.__module__ != _mod.__name__:
                continue

            def _spy(*a, _f=_f, _n=_name, **k):
                calls.append((_n, sorted({type(p).__name__ for p in a[0]})))
                return _f(*a, **k)
            setattr(_mod, _own, _spy)
    return {"record": record(), "patched": patched()}


def accelerator(on):
    O._get_foreach_kernels_supported_devices = (lambda: ["cpu"] + ACCEL()) if on else ACCEL


def params(kind, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(0)
    out = []
    for shape in ((6, 4), (5,)):
        local = (torch.pow(10.0, -3 * torch.rand(shape, generator=gen)) * torch.randn(shape, generator=gen).sign()).to(dtype)
        if kind == "torch":
            out.append(torch.nn.Parameter(TorchDTensor.from_local(local, tmesh, [TorchShard(0)])))
        elif kind == "hyper":
            out.append(hp.DTensor.from_local(local.requires_grad_(), hmesh, (Shard(0),)))
        else:
            out.append(local.requires_grad_())
    return out


def set_grads(ps, step):
    gen = torch.Generator().manual_seed(100 + step)
    for p in ps:
        shape = tuple(p.to_local().shape) if hasattr(p, "to_local") else tuple(p.shape)
        g = (torch.pow(10.0, -10 * torch.rand(shape, generator=gen)) * torch.randn(shape, generator=gen).sign()).to(p.dtype)
        if isinstance(p, TorchDTensor):
            p.grad = TorchDTensor.from_local(g, tmesh, [TorchShard(0)])
        elif hasattr(p, "to_local"):
            p.grad = hp.DTensor.from_local(g, hmesh, (Shard(0),))
        else:
            p.grad = g


def snapshot(ps, opt):
    """Local params and moments after a run, to compare bit for bit with ``same``."""
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t
    return [local(t).detach().clone() for p in ps
            for t in [p] + [opt.state[p][k] for k in ("exp_avg", "exp_avg_sq")]]


def same(a, b):
    return len(a) == len(b) and all(bit_mismatches(x, y)[0] == 0 for x, y in zip(a, b))


def adamw_ops() -> set:
    """Every op torch's Adam/AdamW step runs on params and states, single-tensor, foreach and fused: named in
    ``SkipDTensorDispatch(no_skip=...)`` (new generation), each still dispatches through hyper's DTensor."""
    T = torch.Tensor
    single = {T.lerp_, T.mul_, T.add_, T.addcmul_, T.addcdiv_, T.sqrt, T.div_, T.sub_, T.neg, T.copy_, T.maximum}
    multi = {getattr(torch, f"_foreach_{n}") for n in ("lerp_", "mul_", "add_", "addcmul_", "addcdiv_", "sqrt",
                                                        "div_", "sub_", "neg", "maximum_", "add", "mul", "sqrt_",
                                                        "reciprocal_", "pow", "sub")}
    return single | multi | {torch._fused_adamw_, torch._fused_adam_, torch.zeros_like}


def skip_context(mode):
    """The context a step runs in: none (False), ``SkipDTensorDispatch()`` (True), or with ``no_skip`` naming
    the AdamW ops ("no_skip_adamw") or ``torch.zeros_like`` ("no_skip_zeros_like", hyper's own state init)."""
    import contextlib
    if not mode:
        return contextlib.nullcontext()
    if mode is True:
        return SkipDTensorDispatch()
    return SkipDTensorDispatch(no_skip=adamw_ops() if mode == "no_skip_adamw" else {torch.zeros_like})


def run(kind, steps=8, skip=True, cls=torch.optim.AdamW, **kw):
    ps = params(kind)
    opt = cls(ps, lr=1e-3, weight_decay=0.01, **kw) if cls is not torch.optim.SGD else cls(ps, lr=0.1)
    del calls[:]
    for step in range(steps):
        set_grads(ps, step)
        with skip_context(skip):
            opt.step()
    seen = sorted({c[0] for c in calls})
    return (snapshot(ps, opt) if cls is not torch.optim.SGD else None), seen, sorted({t for c in calls for t in c[1]})


def record():
    return {r["name"]: r for r in npu_fsdp_patches.status()}["hp_skip_dispatch_adamw"]


def patched():
    return hasattr(A.adam, "__npu_fsdp_patch__") and hasattr(AW.adamw, "__npu_fsdp_patch__")


def generation_case(generation: str) -> dict:
    """Every flag on both device kinds, revert/re-apply, torch's own choice, SGD and the state format."""
    from torch.optim.optimizer import _default_to_fused_or_foreach
    import torch.optim.sgd as S
    R = _start(generation)
    for accel in (True, False):
        accelerator(accel)
        tag = "accel" if accel else "cpu"
        R[tag + "_default_choice"] = {k: list(_default_to_fused_or_foreach(params(k), False, False)) for k in ("torch", "hyper")}
        for flags in ({}, {"foreach": True}, {"foreach": False}, {"fused": True}):
            name = f"{tag}_" + ("_".join(f"{k}={v}" for k, v in flags.items()) or "default")
            ref, ref_impl, _ = run("torch", skip=False, **flags)
            got, got_impl, got_types = run("hyper", **flags)
            R[name] = {"equal": same(ref, got), "ref_impl": ref_impl, "impl": got_impl, "types": got_types}
    accelerator(True)
    ref, _, _ = run("torch", skip=False)
    npu_fsdp_patches.revert("hp_skip_dispatch_adamw")
    stock, stock_impl, stock_types = run("hyper")
    R["reverted"] = {"patched": hasattr(A.adam, "__npu_fsdp_patch__") or hasattr(AW.adamw, "__npu_fsdp_patch__"), "impl": stock_impl, "types": stock_types}
    npu_fsdp_patches.apply("hp_skip_dispatch_adamw")
    O._foreach_supported_types.append(hp.DTensor)      # torch would now pick foreach for hyper on its own
    registered, reg_impl, reg_types = run("hyper")
    O._foreach_supported_types.remove(hp.DTensor)
    unregistered, _, _ = run("hyper")
    R["choice_independent"] = {"registered": same(registered, ref), "unregistered": same(unregistered, ref),
                               "registered_impl": reg_impl, "registered_types": reg_types}
    try:
        run("hyper", skip=False)
        R["outside_context"] = "no error"
    except RuntimeError as exc:
        R["outside_context"] = str(exc)
    plain_ref, plain_impl, _ = run("plain", skip=False)
    plain_skip, plain_skip_impl, plain_types = run("plain", skip=True)
    R["plain_under_skip"] = {"equal": same(plain_ref, plain_skip), "impl": plain_skip_impl, "ref_impl": plain_impl,
                             "types": plain_types}
    sgd_before = S.sgd
    _, sgd_impl, _ = run("hyper", cls=torch.optim.SGD)
    R["sgd"] = {"untouched": S.sgd is sgd_before and not hasattr(sgd_before, "__npu_fsdp_patch__"),
                "adam_calls": sgd_impl}
    ps = params("hyper")
    opt = torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01)
    set_grads(ps, 0)
    with SkipDTensorDispatch():
        opt.step()
    state = opt.state_dict()["state"][0]
    R["state"] = {k: [type(v).__name__, list(v.shape)] for k, v in state.items()}
    if generation == "new":
        R["no_skip"] = no_skip_cases()
    return R


def no_skip_cases() -> dict:
    """New generation: inside ``SkipDTensorDispatch(no_skip=...)`` naming the AdamW ops, or
    ``torch.zeros_like`` as hyper's own optimizer-state initialisation does: patched, each flag is bit-exact
    with torch's DTensor and runs torch's implementation for it; the states zeros_like made are hyper
    DTensors. Reverted, the named ops reach hyper's dispatcher (the negative control)."""
    out = {}
    accelerator(True)
    for mode in ("no_skip_adamw", "no_skip_zeros_like"):
        for flags in ({}, {"foreach": True}, {"fused": True}):
            name = f"{mode}_" + ("_".join(f"{k}={v}" for k, v in flags.items()) or "default")
            ref, ref_impl, _ = run("torch", skip=False, **flags)
            got, got_impl, got_types = run("hyper", skip=mode, **flags)
            out[name] = {"equal": same(ref, got), "ref_impl": ref_impl, "impl": got_impl, "types": got_types}
        ps = params("hyper")
        opt = torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01)
        set_grads(ps, 0)
        with skip_context(mode):
            opt.step()
        out[f"{mode}_state_types"] = sorted({type(v).__module__.split(".")[0] + "." + type(v).__name__
                                             for v in opt.state[ps[0]].values()})
    npu_fsdp_patches.revert("hp_skip_dispatch_adamw")
    try:
        run("hyper", skip="no_skip_adamw")
        out["reverted"] = "no error"
    except RuntimeError as exc:
        out["reverted"] = str(exc)
    npu_fsdp_patches.apply("hp_skip_dispatch_adamw")
    return out


def veomni_case() -> dict:
    """veomni's wrap_optimizer captures the bound steps before the patch is applied."""
    from veomni.distributed.hyper_fsdp2 import wrap_optimizer
    from veomni.optim.optimizer import MultiOptimizer
    R = _start("new")
    accelerator(True)
    ref, _, _ = run("torch", skip=False)
    ps = params("hyper")
    sgd_param = hp.DTensor.from_local(torch.ones(3, requires_grad=True), hmesh, (Shard(0),))
    adamw = torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01)
    multi = MultiOptimizer({"adamw": adamw, "sgd": torch.optim.SGD([sgd_param], lr=0.5)})
    wrap_optimizer(multi)                       # captures the bound steps before the patch is applied
    R["before_apply_patched"] = hasattr(A.adam, "__npu_fsdp_patch__") or hasattr(AW.adamw, "__npu_fsdp_patch__")
    npu_fsdp_patches.apply("hp_skip_dispatch_adamw")
    del calls[:]
    for step in range(8):
        set_grads(ps, step)
        sgd_param.grad = hp.DTensor.from_local(torch.full((3,), 2.0), hmesh, (Shard(0),))
        multi.step()
    R["veomni"] = {"equal": same(snapshot(ps, adamw), ref), "impl": sorted({c[0] for c in calls}),
                   "types": sorted({t for c in calls for t in c[1]}), "wrapped": adamw._hyper_step_wrapped,
                   "sgd_param": sgd_param.to_local().tolist()}
    return R


def torch_choice_case() -> dict:
    """One default run on hyper DTensors: the implementations and param types torch's step saw."""
    R = _start("new")
    R["default"] = run("hyper")[1:]
    return R
