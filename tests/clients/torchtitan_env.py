"""Skip a test when torchtitan 0.3.0 is not importable, unless CI requires it (NPU_FSDP_PATCHES_REQUIRE_TORCHTITAN=1).

The pinned environment is built by .ci/steps/46-torchtitan.sh (torchtitan 0.3.0 with torch 2.13.0), as
docs/integrations/torchtitan.md installs it.
"""
from __future__ import annotations

import importlib.util
import os

import pytest

TORCHTITAN_VERSION = "0.3.0"


def require_torchtitan() -> None:
    """Skip (or, under NPU_FSDP_PATCHES_REQUIRE_TORCHTITAN=1, fail) when torchtitan is missing, another
    version, or its checkpointer cannot be imported."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        found = version("torchtitan") if importlib.util.find_spec("torchtitan") else None
    except PackageNotFoundError:
        found = None
    reason = None
    if found != TORCHTITAN_VERSION:
        reason = f"torchtitan {TORCHTITAN_VERSION} is not installed (found {found})"
    else:
        try:
            import torchtitan.components.checkpointer  # noqa: F401
            import torchtitan.components.optimizer  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - a broken install raises more than ImportError
            reason = f"torchtitan {found} is installed but cannot be imported ({type(exc).__name__}: {exc})"
    if reason is None:
        return
    reason += "; run .ci/steps/46-torchtitan.sh to build its pinned venv"
    if os.environ.get("NPU_FSDP_PATCHES_REQUIRE_TORCHTITAN") == "1":
        pytest.fail(reason + " (NPU_FSDP_PATCHES_REQUIRE_TORCHTITAN=1)")
    pytest.skip(reason)
