"""Patch ``te_fused_adam_empty_scale``: fp16 moments crash on a rank that holds an empty shard.

``FusedAdam._apply_scale`` computes the fp16 state scale with ``torch.aminmax(unscaled_state)``,
which raises "cannot compute aminmax over an empty dimension" for a zero-numel local shard. An empty
state has nothing to scale: the replacement returns without touching ``scaled_state`` or ``scale``
(which keeps its initial 1.0) and calls TE's original for every non-empty state. Releases and
upstream status: compat_matrix.yaml, docs/patches.md.
"""
from __future__ import annotations

from npu_fsdp_patches.patch import Patch, unpatched

from .te_fused_adam import FUSED_ADAM_MODULE


def _apply_scale(original):
    def _apply_scale(self, state_name, unscaled_state, scaled_state, scale):
        if unscaled_state.numel() == 0:
            return None
        return original(self, state_name, unscaled_state, scaled_state, scale)
    return _apply_scale


class TeFusedAdamEmptyScale(Patch):
    """An empty state returns early (nothing to scale; its scale stays 1); anything else goes to TE's
    original."""

    name = "te_fused_adam_empty_scale"
    factories = {"_apply_scale": _apply_scale}

    def upstream_scales_empty(self) -> bool:
        """True when the installed ``_apply_scale`` accepts an empty fp16 state (the fix itself)."""
        import importlib
        from types import SimpleNamespace

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
        return True
