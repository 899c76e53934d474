"""The self-test's checks, in run order, and which of them apply to what is installed and enabled.

Importing this module imports no torch: the check modules are imported by the ranks that run them.
Each check module has ``NAME`` and ``run(ctx) -> dict`` (figures; ``{"skipped": why}`` to stand down).
"""
from __future__ import annotations

import importlib.util
from typing import Optional

#: name -> (module under npu_fsdp_patches.selftest.checks, (top-level package, patch) it needs or None)
CHECKS = {
    "adamw_step": ("adamw_step", None),
    "fused_adam": ("fused_adam", None),
    "main_params": ("main_params", None),
    "foreach_adamw": ("foreach_adamw", None),
    "te_fused_adam": ("te_fused_adam", ("transformer_engine", "te_fused_adam_dtensor")),
    "hyper_skip_dispatch": ("hyper_skip_dispatch", ("hyper_parallel", "hp_skip_dispatch_adamw")),
}


def why_not(name: str, decisions: dict) -> Optional[str]:
    """None when check ``name`` applies; else the reason it does not (shown as 'skipped')."""
    needs = CHECKS[name][1]
    if needs is None:
        return None
    package, patch = needs
    if importlib.util.find_spec(package) is None:
        return f"{package} is not installed"
    if decisions.get(patch) != "enabled":
        return f"patch {patch} is {decisions.get(patch, 'unknown')} ({package} installed)"
    return None


def load(name: str):
    """The check module (imports torch)."""
    return importlib.import_module(f"{__name__}.{CHECKS[name][0]}")
