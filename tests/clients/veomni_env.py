"""Skip a test when veomni is not importable, unless CI requires it (NPU_FSDP_PATCHES_REQUIRE_VEOMNI=1).

The pinned environment is built by .ci/steps/40-veomni.sh (veomni 0.1.12 with torch 2.13.0).
"""
from __future__ import annotations

import importlib.util
import os

import pytest

VEOMNI_VERSION = "0.1.12"


def require_veomni() -> None:
    """Skip (or, under NPU_FSDP_PATCHES_REQUIRE_VEOMNI=1, fail) when veomni is missing or another version."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        found = version("veomni") if importlib.util.find_spec("veomni") else None
    except PackageNotFoundError:
        found = None
    if found == VEOMNI_VERSION:
        return
    reason = (f"veomni {VEOMNI_VERSION} is not installed (found {found}); run "
              f".ci/steps/40-veomni.sh to build its pinned venv")
    if os.environ.get("NPU_FSDP_PATCHES_REQUIRE_VEOMNI") == "1":
        pytest.fail(reason + " (NPU_FSDP_PATCHES_REQUIRE_VEOMNI=1)")
    pytest.skip(reason)
