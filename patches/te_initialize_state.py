"""Patch ``te_initialize_state_compat``: one-argument ``initialize_state(param)`` on TE >= 2.1.

Megatron-Core calls ``opt.initialize_state(p)``, but TE >= 2.1 made ``store_param_remainders`` a
required positional (docs/te_fused_adam.md#13-method-signatures). The replacement makes the argument
optional: ``None`` derives the value from the optimizer's own configuration (remainders only for bf16
params with fp32 master weights, TE's step rule), an explicit value that contradicts it raises
``ValueError`` (moot, so accepted, while ``master_weights`` is off), and the original method is called
with the value. Flags are read at call time. Which callers reach the one-argument form (under stock
validation none does: the patch is defensive): compat_matrix.yaml and
docs/te_fused_adam.md#22-initialize_state-call-sites.
"""
from __future__ import annotations

import inspect

from npu_fsdp_patches.patch import Patch, unpatched

from .te_fused_adam import FUSED_ADAM_MODULE


def _initialize_state(original):
    def initialize_state(self, param, store_param_remainders=None):
        from npu_fsdp_patches.optim.fused_adam_state import resolve_remainders
        return original(self, param, resolve_remainders(self, param, store_param_remainders))
    return initialize_state


class TeInitializeStateCompat(Patch):
    """The argument becomes optional: the missing value is derived from the optimizer's configuration
    (remainders only for bf16 params with fp32 master weights); an explicit value that contradicts it
    raises `ValueError`."""

    name = "te_initialize_state_compat"
    factories = {"initialize_state": _initialize_state}

    def upstream_has_default(self) -> bool:
        """True when ``store_param_remainders`` is absent (TE < 2.1) or already has a default."""
        import importlib
        cls = importlib.import_module(FUSED_ADAM_MODULE).FusedAdam
        fn = unpatched(cls.__dict__.get("initialize_state", cls.initialize_state))
        param = inspect.signature(fn).parameters.get("store_param_remainders")
        return param is None or param.default is not inspect.Parameter.empty
