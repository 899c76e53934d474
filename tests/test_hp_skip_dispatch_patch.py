"""Patch hp_skip_dispatch_adamw against the hyper-parallel stand-ins of both generations and the veomni
fork's wrap_optimizer (docs/design.md#44-hp_skip_dispatch_adamw; issue 5 item 2). Each scenario runs in a
fresh interpreter.

Reference everywhere: the same torch optimizer on torch DTensors (1-rank gloo mesh) with the same
flags, i.e. what torch FSDP2 computes. "accelerator" runs pretend cpu has default foreach kernels
(as cuda/npu have), so torch's own choice differs between its DTensor and hyper's.
"""
import json

import pytest

from tests.support import install_fixture, run_python
from tests.torch_versions import ADAMW_IS_ADAM

CHILD = r'''
import json, sys
import torch, torch.distributed as dist
import torch.optim.adam as A
import torch.optim.optimizer as O
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor as TorchDTensor, Shard as TorchShard
import npu_fsdp_patches
import hyper_parallel as hp
from hyper_parallel import SkipDTensorDispatch
GENERATION = "__GENERATION__"
if GENERATION == "new":
    from hyper_parallel.core.dtensor.placement_types import Shard
else:
    from hyper_parallel.core.placement_types import Shard

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
tmesh, hmesh = init_device_mesh("cpu", (1,)), hp.init_device_mesh("cpu", (1,))
import torch.optim.adamw as AW
calls = []
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
ACCEL = O._get_foreach_kernels_supported_devices
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

def bits(ps, opt):
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t
    out = []
    for p in ps:
        for t in [p] + [opt.state[p][k] for k in ("exp_avg", "exp_avg_sq")]:
            out.append(local(t).detach().float().reshape(-1).tolist())
    return out

def run(kind, steps=8, skip=True, cls=torch.optim.AdamW, **kw):
    ps = params(kind)
    opt = cls(ps, lr=1e-3, weight_decay=0.01, **kw) if cls is not torch.optim.SGD else cls(ps, lr=0.1)
    del calls[:]
    for step in range(steps):
        set_grads(ps, step)
        if skip:
            with SkipDTensorDispatch():
                opt.step()
        else:
            opt.step()
    seen = sorted({c[0] for c in calls})
    return (bits(ps, opt) if cls is not torch.optim.SGD else None), seen, sorted({t for c in calls for t in c[1]})

def record():
    return {r["name"]: r for r in npu_fsdp_patches.status()}["hp_skip_dispatch_adamw"]

def patched():
    return hasattr(A.adam, "__npu_fsdp_patch__") and hasattr(AW.adamw, "__npu_fsdp_patch__")

R = {"record": record(), "patched": patched()}
__BODY__
print("RESULT " + json.dumps(R, default=str))
'''

GENERATION_BODY = r'''
from torch.optim.optimizer import _default_to_fused_or_foreach
for accel in (True, False):
    accelerator(accel)
    tag = "accel" if accel else "cpu"
    R[tag + "_default_choice"] = {k: list(_default_to_fused_or_foreach(params(k), False, False)) for k in ("torch", "hyper")}
    for flags in ({}, {"foreach": True}, {"foreach": False}, {"fused": True}):
        name = f"{tag}_" + ("_".join(f"{k}={v}" for k, v in flags.items()) or "default")
        ref, ref_impl, _ = run("torch", skip=False, **flags)
        got, got_impl, got_types = run("hyper", **flags)
        R[name] = {"equal": ref == got, "ref_impl": ref_impl, "impl": got_impl, "types": got_types}
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
R["choice_independent"] = {"registered": registered == ref, "unregistered": unregistered == ref,
                           "registered_impl": reg_impl, "registered_types": reg_types}
try:
    run("hyper", skip=False)
    R["outside_context"] = "no error"
except RuntimeError as exc:
    R["outside_context"] = str(exc)
plain_ref, plain_impl, _ = run("plain", skip=False)
plain_skip, plain_skip_impl, plain_types = run("plain", skip=True)
R["plain_under_skip"] = {"equal": plain_ref == plain_skip, "impl": plain_skip_impl, "ref_impl": plain_impl,
                         "types": plain_types}
import torch.optim.sgd as S
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
'''

VEOMNI_BODY = r'''
from veomni.distributed.hyper_fsdp2 import wrap_optimizer
from veomni.optim.optimizer import MultiOptimizer
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
R["veomni"] = {"equal": bits(ps, adamw) == ref, "impl": sorted({c[0] for c in calls}),
               "types": sorted({t for c in calls for t in c[1]}), "wrapped": adamw._hyper_step_wrapped,
               "sgd_param": sgd_param.to_local().tolist()}
'''


def run_child(tmp_path, sites, body, generation="new", env=None):
    code = CHILD.replace("__GENERATION__", generation).replace("__BODY__", body)
    proc = run_python(code, paths=sites, env=env or {}, timeout=240)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@pytest.fixture(scope="module", params=["new", "old"])
def generation(request, tmp_path_factory):
    site = install_fixture(f"hyper_parallel_{request.param}", tmp_path_factory.mktemp(request.param))
    return request.param, run_child(None, [site], GENERATION_BODY, request.param)


def test_enabled_by_gate_and_applied_at_torch_import(generation):
    _, r = generation
    assert r["patched"]
    assert r["record"]["decision"] == "enabled" and r["record"]["state"] == "applied", r["record"]
    assert r["record"]["targets"] == ["torch.optim.adam:adam", "torch.optim.adamw:adamw",
                                      "torch.optim.adamw:adam?", "torch.optim._functional:adam?",
                                      "torch.optim._functional:adamw?"]
    # torch 2.6's torch.optim.adamw has its own kernels and no `adam` copy
    copies = ["torch.optim.adamw:adam"] if ADAMW_IS_ADAM else []
    assert sorted(r["record"]["applied_targets"]) == sorted(
        ["torch.optim.adam:adam", "torch.optim.adamw:adamw", "torch.optim._functional:adam",
         "torch.optim._functional:adamw"] + copies)


@pytest.mark.parametrize("device", ["accel", "cpu"])
@pytest.mark.parametrize("flags", ["default", "foreach=True", "foreach=False", "fused=True"])
def test_bit_exact_with_torch_dtensor_for_every_flag(generation, device, flags):
    _, r = generation
    case = r[f"{device}_{flags}"]
    assert case["equal"], case
    assert case["impl"] == case["ref_impl"], case      # same torch implementation as for torch DTensor
    assert case["types"] == ["Tensor"], case           # ... run on the plain local shards


def test_torch_alone_picks_single_tensor_for_hyper_type(generation):
    _, r = generation
    assert r["accel_default_choice"] == {"torch": [False, True], "hyper": [False, False]}
    assert r["cpu_default_choice"] == {"torch": [False, False], "hyper": [False, False]}
    assert r["accel_default"]["impl"] == ["_multi_tensor_adam"]
    assert not r["reverted"]["patched"]
    assert r["reverted"]["impl"] == ["_single_tensor_adam"] and r["reverted"]["types"] == ["DTensor"]


def test_patched_step_does_not_depend_on_torch_choice(generation):
    _, r = generation
    assert r["choice_independent"]["registered"] and r["choice_independent"]["unregistered"]
    # hyper type registered: the patch stands aside and torch's own foreach path runs on hyper DTensors
    assert r["choice_independent"]["registered_impl"] == ["_multi_tensor_adam"]
    assert r["choice_independent"]["registered_types"] == ["DTensor"]


def test_outside_context_and_other_optimizers_unchanged(generation):
    _, r = generation
    assert "dose not contain parallel layout infer func" in r["outside_context"]
    plain = r["plain_under_skip"]      # no hyper param: torch's own choice, on the params themselves
    assert plain["equal"] and plain["impl"] == plain["ref_impl"] == ["_multi_tensor_adam"], plain
    assert r["sgd"] == {"untouched": True, "adam_calls": []}


def test_state_keeps_torch_format(generation):
    _, r = generation
    assert r["state"] == {"step": ["Tensor", []], "exp_avg": ["Tensor", [6, 4]], "exp_avg_sq": ["Tensor", [6, 4]]}


def test_veomni_wrap_optimizer_captured_before_apply(tmp_path):
    sites = [install_fixture("hyper_parallel_new", tmp_path), install_fixture("veomni_hyper_fork", tmp_path)]
    r = run_child(tmp_path, sites, VEOMNI_BODY, env={"NPU_FSDP_PATCHES_DISABLE": "hp_skip_dispatch_adamw"})
    assert r["record"]["state"] == "disabled" and not r["before_apply_patched"]
    assert r["veomni"]["wrapped"] and r["veomni"]["equal"], r["veomni"]
    assert r["veomni"]["impl"] == ["_multi_tensor_adam"] and r["veomni"]["types"] == ["Tensor"]
    assert r["veomni"]["sgd_param"] == [-7.0, -7.0, -7.0]   # SGD ran its own step: 1 - 8 * 0.5 * 2


def test_stands_down_when_hyper_registers_its_dtensor(tmp_path):
    site = install_fixture("hyper_parallel_new", tmp_path)
    module = site / "hyper_parallel" / "core" / "dtensor" / "dtensor.py"
    module.write_text(module.read_text() + "\n\nimport torch.optim.optimizer as _optimizer\n"
                      "_optimizer._foreach_supported_types.append(DTensor)  # the upstream fix\n")
    r = run_child(tmp_path, [site], "R['default'] = run('hyper')[1:]")
    assert r["record"]["state"] == "skipped" and "upstream has it" in r["record"]["note"], r["record"]
    assert not r["patched"]
