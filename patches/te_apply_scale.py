"""Patch ``te_fused_adam_empty_scale``: ``FusedAdam._apply_scale`` on an empty state, and on an all-zero
FP8 state.

* **Empty state.** ``_apply_scale`` computes the scale with ``torch.aminmax(unscaled_state)``, which
  raises "cannot compute aminmax over an empty dimension" for a zero-numel local shard (fp16 moments on
  a rank holding an empty shard, TE >= 2.14). An empty state has nothing to scale: it returns without
  touching ``scaled_state`` or ``scale`` (which keeps its initial 1.0).
* **All-zero FP8 state** (``exp_avg_dtype``/``exp_avg_sq_dtype=torch.uint8``). TE computes
  ``scale = absmax / 448`` and casts with ``1 / scale``: for a state that is exactly zero (an MoE expert
  that got no tokens, a zero state loaded on resume) that is an infinite cast scale, the FP8 data become
  NaN and every later dequantisation gives NaN. The replacement computes the scale as TE does, keeps
  ``scale = 1`` where it came out zero (on the device, no host sync), and writes it into the
  ``Float8Tensor`` as the release's own code does; it is the same code for every other state, non-finite
  ones included, so they are scaled bit for bit as TE does.

Which FP8 write a release uses is read from its own ``_apply_scale`` (1.13:
``scaled_state._scale_inv.copy_(scale)``; 2.1 on: ``scaled_state._quantizer.scale.copy_(1 / scale)``). A
release whose FP8 branch already keeps zero states finite keeps its own FP8 branch; one whose FP8 code
matches neither known write fails the patch (rather than report it applied where zero states stay NaN).
fp16 and bf16 states always go to TE's original. Releases and upstream status: compat_matrix.yaml,
docs/patches.md.
"""
from __future__ import annotations

import inspect
import re
from types import SimpleNamespace
from typing import Callable, Optional

from npu_fsdp_patches.patch import Patch, unpatched

from .te_fused_adam import FUSED_ADAM_MODULE

#: the FP8 write of each generation of ``_apply_scale``, as its source spells it, and what it does
_FP8_WRITES = {
    "scaled_state._quantizer.scale.copy_(1/scale)": lambda state, scale: state._quantizer.scale.copy_(1 / scale),
    "scaled_state._scale_inv.copy_(scale)": lambda state, scale: state._scale_inv.copy_(scale),
}
#: the scale computation every generation shares (TE 1.13-2.20 ``_apply_scale``), which the FP8 path repeats
_FORMULA = ("min_val,max_val=torch.aminmax(unscaled_state)", "absmax=torch.maximum(-min_val,max_val)",
            "torch.div(absmax,max_range,out=scale)")


def fp8_write(original) -> Optional[Callable]:
    """The FP8 write of this release's ``_apply_scale``, when its source has the known formula and one
    known write; None otherwise."""
    try:
        source = re.sub(r"\s+", "", inspect.getsource(original))
    except (OSError, TypeError):
        return None
    if not all(part in source for part in _FORMULA):
        return None
    writes = [write for text, write in _FP8_WRITES.items() if text in source]
    return writes[0] if len(writes) == 1 else None


def scale_fp8(opt, state_name, unscaled_state, scaled_state, scale, write) -> None:
    """TE's FP8 branch of ``_apply_scale`` with one change: a zero scale becomes 1 (on the device)."""
    import torch
    dtype = opt.name_to_dtype_map[state_name]
    max_range = opt.dtype_to_range_map[dtype]
    if max_range.device != scaled_state.device:
        max_range = max_range.to(scaled_state.device)
    if unscaled_state.device != scaled_state.device:
        unscaled_state = unscaled_state.to(scaled_state.device)
    min_val, max_val = torch.aminmax(unscaled_state)
    absmax = torch.maximum(-min_val, max_val).to(dtype=torch.float32, device=unscaled_state.device)
    torch.div(absmax, max_range, out=scale)
    scale.copy_(torch.where(scale == 0, torch.ones_like(scale), scale))
    write(scaled_state, scale)
    scaled_state.copy_(unscaled_state)


def _apply_scale(original):
    fixed = _keeps_zero_fp8_finite(original)
    write = None if fixed else fp8_write(original)
    float8_cls = getattr(original, "__globals__", {}).get("Float8Tensor")
    if write is None and float8_cls is not None and not fixed:
        raise RuntimeError("this release's _apply_scale does not compute the FP8 scale with a write the patch "
                           "knows (docs/te_fused_adam.md#19-fp8-moments), so its all-zero FP8 states would stay "
                           "NaN: not applied")

    def _apply_scale(self, state_name, unscaled_state, scaled_state, scale):
        if unscaled_state.numel() == 0:
            return None
        if write is not None and _fp8_path(self, state_name, unscaled_state, scaled_state, float8_cls):
            return scale_fp8(self, state_name, unscaled_state, scaled_state, scale, write)
        return original(self, state_name, unscaled_state, scaled_state, scale)
    return _apply_scale


def _fp8_path(opt, state_name, unscaled_state, scaled_state, float8_cls) -> bool:
    """The state takes TE's FP8 branch and passes its checks (fp32 input, a ``Float8Tensor`` with one
    scale); anything else goes to TE's original, which raises its own assertion where it fails."""
    import torch
    quantizer = getattr(scaled_state, "_quantizer", None)
    return (opt.name_to_dtype_map[state_name] == torch.uint8 and unscaled_state.dtype == torch.float32
            and float8_cls is not None and isinstance(scaled_state, float8_cls)
            and (quantizer is None or len(quantizer.scale) == 1))


class _ProbeState:
    """What ``_apply_scale`` touches of an FP8 state, recorded (built as a subclass of the release's
    ``Float8Tensor`` for its ``isinstance`` check; no TE kernel runs)."""

    _quantizer = _scale_inv = _data = None

    def copy_(self, src):
        self.copied = src
        return self


def _probe_state(float8_cls):
    import torch
    probe_cls = type("_ProbeFloat8Tensor", (_ProbeState, float8_cls), {})
    state = torch.Tensor._make_wrapper_subclass(probe_cls, (2,), dtype=torch.float32, device="cpu")
    state._quantizer = SimpleNamespace(scale=torch.ones(1))
    state._scale_inv = torch.ones(1)
    return state


def _keeps_zero_fp8_finite(fn) -> bool:
    """Runs ``fn`` (an unpatched ``_apply_scale``) on an all-zero FP8 state: True when the cast scale it
    leaves (``_quantizer.scale``, or ``1 / _scale_inv`` in TE 1.x) is finite."""
    import importlib

    import torch
    try:
        float8_cls = importlib.import_module(FUSED_ADAM_MODULE).Float8Tensor
        state = _probe_state(float8_cls)
        fake = SimpleNamespace(name_to_dtype_map={"exp_avg": torch.uint8},
                               dtype_to_range_map={torch.uint8: torch.full([1], 448.0)})
        fn(fake, "exp_avg", torch.zeros(2), state, torch.ones(1))
    except Exception:  # noqa: BLE001 - a release whose FP8 branch cannot run here shows no fix
        return False
    return bool(torch.isfinite(state._quantizer.scale).all() and torch.isfinite(1 / state._scale_inv).all())


class TeFusedAdamEmptyScale(Patch):
    """An empty state returns early (nothing to scale; its scale stays 1). An FP8 (uint8) state is scaled
    as TE scales it, except that a zero scale (an all-zero state) becomes 1, so the state stays finite
    and dequantises to zero; the FP8 write is the release's own. Anything else goes to TE's original."""

    name = "te_fused_adam_empty_scale"
    factories = {"_apply_scale": _apply_scale}

    def upstream_scales_empty(self) -> bool:
        """True when the installed ``_apply_scale`` accepts an empty fp16 state and keeps an all-zero FP8
        state finite (both fixes; a release with one of them keeps it: see ``_apply_scale``)."""
        import importlib

        import torch
        cls = importlib.import_module(FUSED_ADAM_MODULE).FusedAdam
        fn = unpatched(cls.__dict__["_apply_scale"])
        fake = SimpleNamespace(name_to_dtype_map={"exp_avg": torch.float16},
                               dtype_to_range_map={torch.float16: torch.full([1], 32752.0)})
        try:
            fn(fake, "exp_avg", torch.empty(0), torch.empty(0, dtype=torch.float16),
               torch.ones(1))
        except RuntimeError:
            return False
        return _keeps_zero_fp8_finite(fn)
