"""Child side of tests/runtime/test_foreign_wrappers.py: hp_skip_dispatch_adamw next to other patchers
(hyper-parallel stand-in installed, so the patch applies at ``import torch`` through autoload)."""
from __future__ import annotations

import functools


def _step() -> None:
    import torch
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    torch.optim.AdamW([p], lr=0.1).step()


def _record() -> dict:
    import npu_fsdp_patches
    return {r["name"]: r for r in npu_fsdp_patches.status()}["hp_skip_dispatch_adamw"]


def _revert() -> str | None:
    import npu_fsdp_patches
    try:
        npu_fsdp_patches.revert("hp_skip_dispatch_adamw")
    except npu_fsdp_patches.PatchError as exc:
        return str(exc)
    return None


def profile(fn):
    """A profiler's functools.wraps wrapper."""
    @functools.wraps(fn)
    def timed(*args, **kwargs):
        profiled.append("functools")
        return fn(*args, **kwargs)
    return timed


def wrapt_timed(wrapped, instance, args, kwargs):
    profiled.append("wrapt")
    return wrapped(*args, **kwargs)


profiled: list = []


def stacked_case() -> dict:
    """A profiler stacks a functools.wraps and then a wrapt wrapper on ours; revert must not drop it."""
    import torch.optim.adam as A
    import wrapt
    is_marked = lambda f: "__npu_fsdp_patch__" in getattr(f, "__dict__", {})  # noqa: E731
    ours, out = A.adam, {}
    for kind, wrap in (("functools", profile), ("wrapt", lambda fn: wrapt.FunctionWrapper(fn, wrapt_timed))):
        foreign = A.adam = wrap(ours)
        del profiled[:]
        _step()
        record = _record()
        refused = _revert()
        out[kind] = {"ours": is_marked(ours), "profiled": list(profiled), "state": record["state"],
                     "note": record["note"], "refused": refused, "kept": A.adam is foreign,
                     "state_after": _record()["state"]}
        A.adam = ours                     # the profiler removes itself
    import torch
    A.adam = torch.optim.Optimizer.profile_hook_step(ours)   # torch's own step hook: it re-hooks the original
    A.adam.hooked = True
    out["revert_after"] = [_revert(), _record()["state"], hasattr(A.adam, "__npu_fsdp_patch__")]
    return out


def mindspeed_case(plugin_first: bool) -> dict:
    """MindSpeed's patch manager stacks a wrapper on torch.optim.adam.adam and later repatch()es;
    our plugin is activated before it (autoload) or after it (autoload off, then ``import``)."""
    import torch  # noqa: F401 - autoload activates the plugin when plugin_first
    import torch.optim.adam as A
    import mindspeed.megatron_adaptor as adaptor
    import npu_fsdp_patches
    from npu_fsdp_patches.cli.render import _why
    out = {"applied": _record()["state"]}
    del adaptor.calls[:]
    _step()
    out["mindspeed_ran"] = list(adaptor.calls)
    record = _record()
    out["first"] = {"state": record["state"], "note": record["note"], "error": record["error"]}
    if plugin_first:
        out["refused"] = _revert()
    adaptor.repatch()
    installed = A.adam
    record = _record()
    out["after_repatch"] = {"state": record["state"], "note": record["note"], "error": record["error"],
                            "doctor_reason": _why(record)}
    out["revert"] = _revert()
    out["mindspeed_kept"] = A.adam is installed and A.adam.__code__.co_qualname.startswith("adam_profile_wrapper")
    del adaptor.calls[:]
    _step()
    out["mindspeed_ran_after"] = list(adaptor.calls)
    out["state_end"] = _record()["state"]
    return out
