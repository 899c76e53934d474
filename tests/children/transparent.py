"""Child side of tests/runtime/test_transparent_wrappers.py: one fresh interpreter per environment.

``surface`` reports what a user sees of each target (signature, names, docstring, innermost
``__wrapped__``, pickling by reference); ``optim_bits`` the bits of every ``npu_fsdp_patches.optim``
entry point and of torch's own Adam/AdamW with weight decay on; ``compiled`` the graph breaks and
results of torch.compile'd Adam/AdamW steps. The test runs them unpatched (``NPU_FSDP_PATCHES=0``)
and patched, and compares.
"""
from __future__ import annotations

import importlib
import inspect
import pickle
from typing import Any


def _lookup(symbol: str) -> tuple[Any, Any, str]:
    module_name, qualname = symbol.split(":")
    owner: Any = importlib.import_module(module_name)
    *path, attr = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, getattr(owner, attr), attr


def _innermost(fn: Any) -> str:
    inner = inspect.unwrap(getattr(fn, "__func__", fn))
    code = getattr(inner, "__code__", None)
    return f"{code.co_filename}:{code.co_firstlineno}" if code else repr(inner)


def _pickled(fn: Any) -> str:
    try:
        loaded = pickle.loads(pickle.dumps(fn))
    except Exception as exc:  # noqa: BLE001 - reported, compared with the unpatched run
        return f"{type(exc).__name__}: {exc}"
    return "same object" if loaded is fn or loaded == fn else f"another object: {loaded!r}"


def surface(targets: list) -> dict:
    """Per target: the public surface, whether our replacement is installed there and whether its
    ``__wrapped__`` is the original."""
    import torch  # noqa: F401 - autoload activates the plugin, as for a user
    from npu_fsdp_patches.patch import unpatched
    is_marked = lambda f: "__npu_fsdp_patch__" in getattr(f, "__dict__", {})  # noqa: E731 - no foreign wrappers here
    out = {}
    for symbol in targets:
        owner, fn, attr = _lookup(symbol)
        raw = vars(owner).get(attr, fn) if isinstance(owner, type) else fn
        func = getattr(raw, "__func__", raw)
        out[symbol] = {
            "signature": str(inspect.signature(fn)),
            "names": [getattr(func, a, None) for a in ("__name__", "__qualname__", "__module__", "__doc__")],
            "innermost": _innermost(fn),
            "pickle": _pickled(fn),
            "ours": is_marked(func) or is_marked(raw),
            "wraps_original": getattr(func, "__wrapped__", None) is unpatched(func) is not func,
        }
    import npu_fsdp_patches
    out["applied"] = sorted(s for r in npu_fsdp_patches.status() for s in r["applied_targets"])
    return out


def _params(dtype) -> list:
    import torch
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter((torch.randn(shape, generator=gen) * 0.3).to(dtype)) for shape in ((7, 3), (5,), (1,))]


def _grads(params: list, step: int) -> None:
    import torch
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(p.dtype)


def _bits(tensors: list) -> list:
    import torch
    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float64: torch.int64}
    return [t.detach().contiguous().view(view[t.dtype]).flatten().tolist() for t in tensors]


def _run(build, step, dtype, steps: int = 3) -> list:
    params = _params(dtype)
    optimizer = build(params)
    for i in range(steps):
        _grads(params, i)
        step(optimizer)
    return _bits(params)


def optim_bits(apply_after_import: bool = False) -> dict:
    """Bits of npu_fsdp_patches.optim's steps and of torch's plain Adam/AdamW, weight decay on.

    ``apply_after_import``: npu_fsdp_patches.optim is imported with the patch disabled
    (NPU_FSDP_PATCHES_DISABLE), then ``apply()`` installs it; else autoload applied it at ``import torch``.
    """
    import torch
    import npu_fsdp_patches
    from npu_fsdp_patches.optim import FusedAdam, MainParamsOptimizer, foreach_adamw_step
    if apply_after_import:
        npu_fsdp_patches.apply("hp_skip_dispatch_adamw")
    state = {r["name"]: r["state"] for r in npu_fsdp_patches.status()}.get("hp_skip_dispatch_adamw")
    fp32, bf16 = torch.float32, torch.bfloat16
    adamw = lambda **kw: (lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.5, **kw))  # noqa: E731
    adam = lambda **kw: (lambda ps: torch.optim.Adam(ps, lr=0.1, weight_decay=0.5, **kw))  # noqa: E731
    plain = lambda opt: opt.step()  # noqa: E731
    ours = lambda opt: foreach_adamw_step(opt)  # noqa: E731
    cases = {
        "foreach_adamw_step/AdamW": (adamw(), ours, fp32),
        "foreach_adamw_step/AdamW/bf16": (adamw(), ours, bf16),
        "foreach_adamw_step/Adam/amsgrad": (adam(amsgrad=True), ours, fp32),
        "FusedAdam": (lambda ps: FusedAdam(ps, lr=0.1, weight_decay=0.5), plain, fp32),
        "MainParamsOptimizer/AdamW/bf16": (None, plain, bf16),
        "torch/AdamW/foreach": (adamw(foreach=True), plain, fp32),
        "torch/AdamW/single": (adamw(foreach=False), plain, fp32),
        "torch/AdamW/fused": (adamw(fused=True), plain, fp32),
        "torch/Adam/foreach": (adam(foreach=True), plain, fp32),
        "torch/Adam/single": (adam(foreach=False), plain, fp32),
    }
    out = {}
    for name, (build, step, dtype) in cases.items():
        if build is None:
            torch.manual_seed(0)
            model = torch.nn.Linear(3, 2).to(dtype)
            params = list(model.parameters())
            opt = MainParamsOptimizer(torch.optim.AdamW(params, lr=0.1, weight_decay=0.5), model)
            for i in range(3):
                _grads(params, i)
                opt.step()
            out[name] = _bits(params)
        else:
            out[name] = _run(build, step, dtype)
    one = torch.nn.Parameter(torch.ones(1))   # issue 17's case: 0.85 decoupled, 0.90 with L2 decay
    one.grad = torch.ones(1)
    foreach_adamw_step(torch.optim.AdamW([one], lr=0.1, weight_decay=0.5))
    return {"state": state, "bits": out, "one_step": one.item()}


def compiled() -> dict:
    """Graph breaks, frames and result bits of a torch.compile'd AdamW step (fused and foreach)."""
    import torch
    from torch._dynamo.testing import CompileCounter
    from torch._dynamo.utils import counters
    out = {}
    for flag in ("fused", "foreach"):
        torch._dynamo.reset()
        counters.clear()
        params = _params(torch.float32)
        optimizer = torch.optim.AdamW(params, lr=0.1, weight_decay=0.5, **{flag: True})
        counter = CompileCounter()
        step = torch.compile(optimizer.step, backend=counter)
        for i in range(2):
            _grads(params, i)
            step()
        out[flag] = {"graph_breaks": sum(counters["graph_break"].values()), "frames": counter.frame_count,
                     "bits": _bits(params)}
    return out


def hyper_case(targets: list, apply_after_import: bool = False, compile_too: bool = True) -> dict:
    """Everything one hyper-parallel environment reports, in one launch."""
    result = {"optim": optim_bits(apply_after_import), "surface": surface(targets)}
    if compile_too:
        result["compiled"] = compiled()
    return result
