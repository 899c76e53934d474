"""fp16 loss scaling through torch's own ``torch.amp.GradScaler`` (docs/main_params.md#fp16-and-torchs-gradscaler).

torch's recipe, ``scaler.scale(loss).backward(); scaler.unscale_(opt); clip_grad_norm_(model.parameters(),
max_norm); scaler.step(opt); scaler.update()``, meets two walls with fp16 model params: ``unscale_`` refuses
fp16 grads ("Attempting to unscale FP16 gradients": unscaled in fp16 they would underflow), and a skipped step
must leave the fp32 main params alone. The wrapper uses the two mechanisms torch offers, as Megatron's
``MixedPrecisionOptimizer`` does with its own scaler (unscale the fp32 main grads, skip the step on inf/NaN):

* ``Tensor.grad_dtype`` (torch >= 2.10): an fp16 param may hold a grad of another dtype. The wrapper sets
  ``grad_dtype = None`` on its fp16 params and a post-accumulate-grad hook that widens their grad to fp32 once
  autograd (or FSDP2's reduce-scatter, which calls the same hooks) has produced it. ``unscale_`` then
  unscales fp32 grads and ``clip_grad_norm_`` clips them exactly as an fp32 master's; the step casts nothing.
  ``None`` rather than ``float32``: FSDP2 assigns the sharded grad in the param's dtype, and torch's
  ``_init_optim_state`` assigns ``zeros_like(param)``; both must stay accepted.
* ``_step_supports_amp_scaling``: ``GradScaler.step`` then hands the optimizer the scale (``grad_scale``,
  unless ``unscale_`` already ran) and the inf/NaN flag (``found_inf``) and calls its step. The wrapper skips
  the whole step on inf/NaN (main params, moments, step counts and model params untouched), and otherwise
  unscales the fp32 main grads after the cast with the kernel and factor torch's ``unscale_`` uses. So the short
  form ``scaler.step(opt)`` works on every torch, fp16 included.
"""
from __future__ import annotations

import weakref
from collections import defaultdict
from typing import Any

import torch

from .tensors import is_foreign_dtensor, local_tensor

__all__ = ["WIDENS_FP16_GRADS", "widened", "widen_fp16_grads", "found_inf", "unscale_"]

#: torch >= 2.10: ``Tensor.grad_dtype`` lets an fp16 param hold an fp32 grad (pytorch/pytorch#162815)
WIDENS_FP16_GRADS = hasattr(torch.Tensor, "grad_dtype")


def widened(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The params whose grads :func:`widen_fp16_grads` widens: trainable fp16 ones (hyper-parallel DTensors
    excepted, whose ops fail outside their dispatch context), on a torch that has ``grad_dtype``."""
    if not WIDENS_FP16_GRADS:
        return []
    return [p for p in params if p.dtype == torch.float16 and p.requires_grad and not is_foreign_dtensor(p)]


def widen_fp16_grads(owner: Any, params: list[torch.Tensor], handles: list) -> None:
    """Let each param of :func:`widened` ``(params)`` hold fp32 grads, widened by a hook as backward produces
    them; the hook handles are appended to ``handles``. A hook acts only while ``owner`` (the wrapper) lives and
    lists its param in ``owner._widened``. A failure midway undoes what this call did, then raises."""
    owner_ref = weakref.ref(owner)

    def widen(p: torch.Tensor) -> None:
        wrapper = owner_ref()
        if wrapper is not None and id(p) in wrapper._widened and p.grad is not None and p.grad.dtype == torch.float16:
            p.grad = p.grad.float()   # a DTensor grad casts its local shard: no collective

    done: list[tuple[torch.Tensor, Any]] = []   # (param, its grad_dtype before)
    start = len(handles)
    try:
        for p in widened(params):
            done.append((p, p.grad_dtype))
            p.grad_dtype = None
            handles.append(p.register_post_accumulate_grad_hook(widen))
    except BaseException:
        for handle in handles[start:]:
            handle.remove()
        del handles[start:]
        for p, before in reversed(done):
            if p.grad is None or p.grad.dtype == before:
                p.grad_dtype = before
        raise


def found_inf(optimizer: Any) -> bool:
    """``GradScaler.step`` found an inf/NaN grad (it sets ``optimizer.found_inf`` for the step's duration)."""
    flag = getattr(optimizer, "found_inf", None)
    return flag is not None and bool(flag)


@torch.no_grad()
def unscale_(grads: list[torch.Tensor], scale: torch.Tensor) -> None:
    """Divide ``grads`` (local shards: no collective) by ``scale`` in place, as ``GradScaler.unscale_`` does:
    the reciprocal taken in float64, then torch's own unscale kernel per device and dtype."""
    inv = scale.double().reciprocal().float()
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for grad in grads:
        local = local_tensor(grad)
        groups[(local.device, local.dtype)].append(local)
    for (device, _), group in groups.items():
        ignored = torch.zeros((), dtype=torch.float32, device=device)   # GradScaler has the flag already
        torch._amp_foreach_non_finite_check_and_unscale_(group, ignored, inv.to(device))
