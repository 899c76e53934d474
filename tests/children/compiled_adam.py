"""Child side of tests/test_compiled_adam.py: torch.compile'd torch Adam/AdamW steps, in one fresh
interpreter per environment (plugin on or off), with the hyper-parallel stand-in installed and its
dispatch module imported as hyper's trainer imports it.

Each run reports what the pytest side compares between the patched and the unpatched interpreter: the
bits of every param and state after the steps (as integers, so JSON keeps them exact), the graph breaks
dynamo counted, and the graphs and ops it captured (``torch._dynamo.utils.counters``), or the error the
compiled step raised. ``plain_case`` runs plain tensors in one process, ``dtensor_case`` one rank of
torch DTensors with uneven shards (a ``tests.distributed.run_ranks`` target).
"""
from __future__ import annotations

import importlib
import re
import sys
from typing import Any

#: torch's four implementations, as a user selects them, and options that take other branches of them:
#: amsgrad with maximize, amsgrad on the foreach path, and a tensor lr (torch's way to change the lr without
#: recompiling; with foreach torch requires capturable=True), decayed in place before every step
IMPLS = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}, "single": {"foreach": False},
         "amsgrad_maximize": {"amsgrad": True, "maximize": True}, "foreach_amsgrad": {"foreach": True, "amsgrad": True},
         "tensor_lr": {"foreach": True, "capturable": True, "lr": "tensor"}}
DISPATCH_MODULE = "hyper_parallel.core.shard._op_dispatch"
#: what hyper's training imports before it steps: the trainer (hp_fp32_main_params' target) and the
#: dispatch module (SkipDTensorDispatch's switch), so both hyper patches are applied where their gates hold
TRAINING_MODULES = ("hyper_parallel.trainer.base", DISPATCH_MODULE)
#: the params of every run: fp32 and bf16 (two dtype groups), uneven under Shard(0) on 2 ranks
SHAPES = (((5, 3), "float32"), ((3,), "bfloat16"), ((2, 2), "float32"))


def _bits(t) -> list:
    """The element bits of ``t`` (its local shard for a DTensor) as integers."""
    import torch
    t = t.to_local() if hasattr(t, "to_local") else t
    t = t.detach().contiguous().reshape(-1)
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
    return t.view(ints[t.dtype]).tolist()


def _environment() -> dict:
    """Which patches are applied, and that hyper's dispatch module is loaded as in training."""
    import torch
    import torch.optim.adam as adam_module
    import npu_fsdp_patches
    return {"torch": torch.__version__, "applied": sorted(r["name"] for r in npu_fsdp_patches.status() if r["state"] == "applied"),
            "adam_wrapped": hasattr(adam_module.adam, "__npu_fsdp_patch__"),
            "dispatch_loaded": DISPATCH_MODULE in sys.modules,
            "dispatch_is_contextvar": type(getattr(sys.modules[DISPATCH_MODULE], "_dtensor_dispatch_disabled", None)
                                           ).__name__ == "ContextVar"}


def _import_as_in_training() -> None:
    """Import what the installed generation has of ``TRAINING_MODULES`` (the old one has no trainer)."""
    import importlib.util
    for name in TRAINING_MODULES:
        if importlib.util.find_spec(name.rsplit(".", 1)[0]) and importlib.util.find_spec(name):
            importlib.import_module(name)


def _skip_context(under_skip):
    """No context (False), ``SkipDTensorDispatch()`` (True), or ``SkipDTensorDispatch(no_skip=...)`` naming the
    AdamW ops ("no_skip": the new generation, tests/children/hp_skip_dispatch.py ``adamw_ops``)."""
    import contextlib
    if not under_skip:
        return contextlib.nullcontext()
    from hyper_parallel import SkipDTensorDispatch
    if under_skip == "no_skip":
        from tests.children.hp_skip_dispatch import adamw_ops
        return SkipDTensorDispatch(no_skip=adamw_ops())
    return SkipDTensorDispatch()


def run_key(cls_name: str, impl: str, backend: str, under_skip) -> str:
    """A run's name in the results: class/impl/backend, with /skip or /no_skip for its context."""
    return f"{cls_name}/{impl}/{backend}" + {False: "", True: "/skip", "no_skip": "/no_skip"}[under_skip]


def _reason(key) -> str:
    """A graph-break reason's headline, without the object addresses some torch put in it (torch 2.6:
    "call torch._dynamo.disable() wrapped function <function _fused_adamw at 0x7f...>"), which differ
    between the two interpreters compared."""
    return re.sub(r" at 0x[0-9a-fA-F]+>", " at 0x...>", str(key).split("\n")[0])[:160]


def _compiled_run(cls_name: str, impl: str, backend: str, make, steps: int, under_skip: bool = False) -> dict:
    """``steps`` compiled steps of a fresh optimizer over ``make()``'s params and grads."""
    import time
    import torch
    import torch._dynamo
    from torch._dynamo.utils import counters
    start = time.process_time()
    torch._dynamo.reset()
    counters.clear()
    params, set_grads = make()
    cls = getattr(torch.optim, cls_name)
    options = {"lr": 1e-2, **IMPLS[impl]}
    tensor_lr = options["lr"] == "tensor"
    if tensor_lr:
        options["lr"] = torch.tensor(1e-2)
    opt = cls(params, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, **options)
    step = torch.compile(opt.step, backend=backend)
    try:
        for i in range(steps):
            set_grads(i)
            if tensor_lr and i:
                options["lr"].mul_(0.5)
            with _skip_context(under_skip):
                step()
    except Exception as exc:  # noqa: BLE001 - reported, compared with the other environment
        return {"error": f"{type(exc).__name__}: {str(exc)[:600]}"}
    reasons = sorted({_reason(k) for k in counters["graph_break"]})
    keys = ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if "amsgrad" in impl else ())
    return {"bits": [[_bits(p)] + [_bits(opt.state[p][k]) for k in keys] for p in params],
            "graph_breaks": sum(counters["graph_break"].values()), "break_reasons": reasons,
            "graphs": counters["stats"]["unique_graphs"], "ops": counters["stats"]["calls_captured"],
            "cpu_s": round(time.process_time() - start, 2)}


def _plain_params():
    import torch
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(shape, generator=gen).to(getattr(torch, dtype)).requires_grad_()
              for shape, dtype in SHAPES]

    def set_grads(i):
        g = torch.Generator().manual_seed(100 + i)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
    return params, set_grads


def plain_case(runs: list, steps: int = 3, plugin_first: bool = False) -> dict:
    """Each of ``runs`` ([optimizer class, impl, backend, under_skip]) on plain tensors; with
    ``plugin_first`` the plugin is imported before torch (its hooks then apply the patches while
    ``import torch`` runs), else torch's autoload activates it at the end of ``import torch``."""
    if plugin_first:
        assert "torch" not in sys.modules
        import npu_fsdp_patches  # noqa: F401 - activates before torch exists
    _import_as_in_training()
    out = {"environment": _environment()}
    for cls_name, impl, backend, under_skip in runs:
        out[run_key(cls_name, impl, backend, under_skip)] = _compiled_run(cls_name, impl, backend, _plain_params,
                                                                          steps, under_skip)
    return out


def dtensor_case(rank: int, world: int, runs: list, steps: int = 3) -> dict:
    """One rank: each of ``runs`` on torch DTensors sharded Shard(0) over ``world`` gloo ranks (uneven)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    _import_as_in_training()
    mesh = init_device_mesh("cpu", (world,))

    def make():
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(distribute_tensor(torch.randn(shape, generator=gen).to(getattr(torch, dtype)),
                                                       mesh, [Shard(0)])) for shape, dtype in SHAPES]

        def set_grads(i):
            g = torch.Generator().manual_seed(100 + i)
            for p in params:
                p.grad = distribute_tensor(torch.randn(p.shape, generator=g).to(p.dtype), mesh, [Shard(0)])
        return params, set_grads

    out: dict[str, Any] = {"environment": _environment(),
                           "local_rows": [list(p.to_local().shape) for p in make()[0]]}
    for cls_name, impl, backend, under_skip in runs:
        out[run_key(cls_name, impl, backend, under_skip)] = _compiled_run(cls_name, impl, backend, make, steps,
                                                                          under_skip)
    return out
