"""npu_fsdp_patches: versioned, revertible fixes for optimizer bugs of NPU stacks under FSDP2/DTensor.

Importing this package activates the plugin (docs/design.md#31-activation): it reads the
NPU_FSDP_PATCHES_* env vars, detects installed frameworks from their metadata, evaluates
compat_matrix.yaml and registers post-import hooks for the enabled patches. It imports neither torch
nor any target framework.
"""
from __future__ import annotations

import os
import sys
from typing import Any

from .errors import ConfigError, MatrixError, PatchError
from .runtime.facade import RUNTIME as _RUNTIME
from .runtime.job_log import run_module as _run_module

__version__ = "0.1.0"
__all__ = ["__version__", "PatchError", "ConfigError", "MatrixError", "status", "apply", "revert", "detect"]


def status() -> list:
    """One record per patch: name, decision, reason, state, error, targets, verified, ..."""
    return _RUNTIME.status()


def apply(*names: str) -> list:
    """Apply the named patches even where the matrix says no (all matrix-enabled ones if none given).

    An explicit request: a failure raises PatchError. Targets not imported yet are patched on import.
    """
    return _RUNTIME.apply(names)


def revert(*names: str) -> list:
    """Restore exactly the originals that apply installed (every applied patch if none given)."""
    return _RUNTIME.revert(names)


def detect() -> dict[str, Any]:
    """Detected frameworks: version, location, source and flavor, read without importing them."""
    _RUNTIME.ensure_prepared()
    return {name: info.as_dict() for name, info in _RUNTIME.snapshot().frameworks.items()}


def _started_as_cli() -> bool:
    """True in the ``npu-fsdp-patches`` / ``python -m npu_fsdp_patches`` process: there a strict
    activation error is reported by the CLI (exit code 2, complete JSON) instead of killing the import."""
    if _run_module(list(getattr(sys, "orig_argv", None) or [])) in ("npu_fsdp_patches", "npu_fsdp_patches.cli"):
        return True
    return bool(sys.argv) and os.path.basename(sys.argv[0]) == "npu-fsdp-patches"


try:
    _RUNTIME.activate()
except PatchError:
    if not _started_as_cli():
        raise
