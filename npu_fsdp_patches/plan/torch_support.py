"""Which torch npu_fsdp_patches supports and which the suite verified, as doctor findings.

Both come from compat_matrix.yaml's ``defaults:``, their one home: the torch floor (``defaults.gate``,
which every patch's gate also carries, so below it each decision names the installed torch) and the
verified torch (``defaults.verified``, every torch CI runs the suite on). A matrix that failed to load
is replaced by the shipped one here, so doctor still reports an unsupported torch.
Reads detection results only: torch is never imported here.
"""
from __future__ import annotations

from packaging.version import InvalidVersion, Version

from ..errors import MatrixError
from .decide import public_version
from .detect import Detected
from .matrix import Matrix, load_matrix
from .versions import VersionBounds, release_of


def supported_torch(matrix: Matrix) -> VersionBounds | None:
    """The torch floor every patch of ``matrix`` gates on (its ``defaults.gate``), None without one."""
    condition = matrix.defaults.condition("torch")
    return condition.version if condition is not None else None


def verified_torch(matrix: Matrix) -> list:
    """Every torch version some patch of ``matrix`` was verified on, oldest first."""
    versions = {v for spec in matrix.patches.values() for v in spec.verified.get("torch", ())}
    return sorted(versions, key=Version)


def torch_findings(torch: Detected | None, matrix: Matrix | None) -> list:
    """Doctor warnings about the installed torch: unsupported, or supported but never verified."""
    if torch is None or not torch.installed or not torch.version:
        return []
    if matrix is None:
        try:
            matrix = load_matrix()
        except MatrixError:
            return []
    supported = supported_torch(matrix)
    try:
        release = release_of(torch.version)   # the gates' rule: 2.6.0a0 counts as 2.6.0
    except InvalidVersion:
        return [f"torch version {torch.version!r} is not a PEP 440 version: cannot check it against "
                f"the supported torch {supported or 'of the matrix'}"]
    if supported is not None and not supported.holds_for(release):
        return [f"torch {torch.version} is unsupported: npu_fsdp_patches needs torch {supported} "
                f"(compat_matrix.yaml defaults; FSDP2's fully_shard is public from torch 2.6); no patch applies"]
    verified = verified_torch(matrix)
    if verified and public_version(torch.version) not in verified:
        return [f"torch {torch.version} is not a verified torch version (the suite runs on torch "
                f"{', '.join(verified)})"]
    return []
