"""Which torch npu_fsdp_patches supports and which the suite verified, as doctor findings.

Supported is torch >= 2.6: FSDP2's ``fully_shard`` is public API from 2.6 and torch_npu ships from
2.6. Every patch's gate in compat_matrix.yaml carries the same bound, so below it each decision names
the installed torch; the verified torch versions are those the patches' ``verified`` lists name.
Reads detection results only: torch is never imported here.
"""
from __future__ import annotations

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from .decide import public_version
from .detect import Detected
from .matrix import Matrix

SUPPORTED_TORCH = SpecifierSet(">=2.6")


def verified_torch(matrix: Matrix) -> list:
    """Every torch version some patch of ``matrix`` was verified on, oldest first."""
    versions = {v for spec in matrix.patches.values() for v in spec.verified.get("torch", ())}
    return sorted(versions, key=Version)


def torch_findings(torch: Detected | None, matrix: Matrix | None) -> list:
    """Doctor warnings about the installed torch: unsupported, or supported but never verified."""
    if torch is None or not torch.installed or not torch.version:
        return []
    try:
        version = Version(torch.version)
    except InvalidVersion:
        return [f"torch version {torch.version!r} is not a PEP 440 version: cannot check it against "
                f"the supported torch {SUPPORTED_TORCH}"]
    if not SUPPORTED_TORCH.contains(version, prereleases=True):
        return [f"torch {torch.version} is unsupported: npu_fsdp_patches needs torch {SUPPORTED_TORCH} "
                f"(FSDP2 fully_shard is public from 2.6); no patch applies"]
    verified = verified_torch(matrix) if matrix is not None else []
    if verified and public_version(torch.version) not in verified:
        return [f"torch {torch.version} is not a verified torch version (the suite runs on torch "
                f"{', '.join(verified)})"]
    return []
