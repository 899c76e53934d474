"""Patch ``te_fused_adam_empty_group_step``: the step counter of a param group that is empty on this rank.

TE's ``FusedAdam.step`` skips a group without params before it advances ``group["step"]``
(NVIDIA/TransformerEngine#1986; every release before 2.19, and TE-NPU). Under a distributed
optimizer each rank's FusedAdam holds only its own shard, so a group (``no_weight_decay`` norms, an
expert group) is empty on some ranks: their counter stays behind, is saved in ``param_groups``, and a
rank that resumes from it applies the wrong bias correction ``1 - beta**step``. TE 2.19 (734ce31e,
PR #3318) advances every group's counter before it skips the empty ones.

``FusedAdam.step`` itself is ``te_fused_adam_dtensor``'s target on some releases (one patch per
object), so this patch targets the constructor: each FusedAdam built while it is applied gets a
step pre-hook and post-hook (torch's optimizer hook API, which torch's hooked ``step`` runs on every
call), and so does each one built before the patch was first applied. The pre-hook notes the counter
of each empty group; after a step that did not move it, the post-hook advances it by TE 2.19's rule.
A step that already advanced it (our DTensor step) is left alone, a group with params is never
touched, and hooks of a reverted patch do nothing.
Releases and upstream status: compat_matrix.yaml, docs/patches.md.
"""
from __future__ import annotations

import sys
import weakref
from types import SimpleNamespace

from npu_fsdp_patches.patch import PATCH_MARK, Patch, is_marked, unpatched

from .te_fused_adam import FUSED_ADAM_MODULE

NAME = "te_fused_adam_empty_group_step"
_MISSING = object()
#: the optimizers that carry our hooks (each gets them once, also across revert and apply)
_HOOKED: "weakref.WeakSet" = weakref.WeakSet()


def advance(opt, group: dict) -> None:
    """TE 2.19's counter rule for one group (``fused_adam.py`` ``step``, 2.19.0 L559-583): +1, or from
    the overflow flag in capturable mode, starting at 1 (a tensor on the flag's device when capturable)."""
    import torch
    capturable = getattr(opt, "capturable", False)
    if "step" in group:
        group["step"] += 1 if not capturable else (opt._dummy_overflow_buf != 1).to(torch.int)
    else:
        group["step"] = (1 if not capturable else
                         torch.tensor([1], dtype=torch.int, device=opt._dummy_overflow_buf.device))


def _unmoved(before, group: dict) -> bool:
    """The step left this counter as it was: an int compares by value; a capturable tensor counter is
    moved in place only by TE's own kernels, which never see an empty group, so identity (no host sync)."""
    now = group.get("step", _MISSING)
    if now is _MISSING or before is _MISSING:
        return now is before
    if type(now) is not type(before):
        return False
    return now is before if hasattr(now, "device") else now == before


def _active(opt) -> bool:
    """This patch is still applied on a class ``opt`` is built from (a reverted patch's hooks do nothing)."""
    for klass in type(opt).__mro__:
        init = klass.__dict__.get("__init__")
        if init is not None and is_marked(init) and getattr(init, PATCH_MARK, None) == NAME:
            return True
    return False


def _hooks():
    """A pre-hook and a post-hook sharing one optimizer's notes of its empty groups' counters."""
    notes: list = []

    def note_empty_groups(opt, args, kwargs):
        notes.clear()
        if _active(opt):
            notes.extend((g, g.get("step", _MISSING)) for g in opt.param_groups if len(g["params"]) == 0)

    def advance_empty_groups(opt, args, kwargs):
        for group, before in notes:
            if _unmoved(before, group):
                advance(opt, group)
        notes.clear()

    return note_empty_groups, advance_empty_groups


def _add_hooks(opt) -> None:
    if opt not in _HOOKED:
        pre, post = _hooks()
        opt.register_step_pre_hook(pre)
        opt.register_step_post_hook(post)
        _HOOKED.add(opt)


def _hook_existing() -> None:
    """Hook the FusedAdam objects built before the patch was first applied (its module imported before the
    plugin activated). Torch wraps a class's ``step`` for profiling when the first object of it is built, so
    an unwrapped ``step`` proves there is none and the scan of the heap is skipped."""
    cls = getattr(sys.modules.get(FUSED_ADAM_MODULE), "FusedAdam", None)
    if cls is None or not getattr(unpatched(cls.__dict__.get("step")), "hooked", False):
        return
    import gc
    for obj in gc.get_referrers(cls):
        if isinstance(obj, cls):
            _add_hooks(obj)


def _init(original):
    _hook_existing()

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _add_hooks(self)
    return __init__


def _step_function(cls):
    """The class's own step as TE wrote it: without our replacement and without torch's hook wrapper."""
    fn = unpatched(cls.__dict__.get("step", getattr(cls, "step", None)))
    for _ in range(4):
        if not getattr(fn, "hooked", False) or not hasattr(fn, "__wrapped__"):
            break
        fn = unpatched(fn.__wrapped__)
    return fn


class TeFusedAdamEmptyGroupStep(Patch):
    """Every FusedAdam built while the patch is applied, or before it was first applied, gets a step
    pre-hook and post-hook (torch's optimizer hook API): after each step, a param group without params on this rank advances its
    counter `group["step"]` exactly as TE 2.19 does (+1, or from the overflow flag when capturable;
    734ce31e, PR #3318), unless the step already did. Groups with params are not touched, so they step
    bit for bit as before; TE's `step` itself is left to `te_fused_adam_dtensor`."""

    name = "te_fused_adam_empty_group_step"
    factories = {"__init__": _init}

    def upstream_advances_empty_groups(self) -> bool:
        """True when the installed class's own ``step`` advances an empty group's counter (the fix).

        Runs that step, unwrapped, on a stand-in optimizer holding one empty group (TE's step reaches
        no kernel and no tensor of a param then). Anything it raises means no fix can be seen: False.
        """
        import importlib

        import torch
        cls = importlib.import_module(FUSED_ADAM_MODULE).FusedAdam
        group: dict = {"params": []}
        fake = SimpleNamespace(param_groups=[group], capturable=False, defaults={},
                               _dummy_overflow_buf=torch.zeros([1], dtype=torch.int))
        try:
            _step_function(cls)(fake)
        except Exception:  # noqa: BLE001 - a step that cannot run on the stand-in shows no fix
            return False
        return "step" in group
