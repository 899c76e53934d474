"""A read-only picture of the runtime for doctor, the CLI and tests (runtime.Runtime.snapshot).

They read this instead of the runtime's attributes, so the runtime can change how it keeps its state
without changing what they report.
"""
from __future__ import annotations

from typing import Mapping, NamedTuple

from ..plan.matrix import Matrix
from ..plan.settings import Settings


class RuntimeSnapshot(NamedTuple):
    settings: Settings
    config_error: str | None       # why the plugin is inactive (bad env var or matrix), else None
    matrix: Matrix | None          # None: not loaded (kill switch before doctor, or a bad configuration)
    frameworks: Mapping            # framework name -> detect.Detected, late finds included
    records: tuple                 # PatchRecord.as_dict() per patch, in matrix order
    late_detections: tuple         # LateDetection.found: frameworks found after activation
    provider_conflicts: Mapping    # patch name -> message, names that two distributions claim

    @property
    def active(self) -> bool:
        return self.settings.active and self.config_error is None

    @property
    def matrix_path(self) -> str | None:
        """The matrix in use, else the one the settings name."""
        return self.matrix.path if self.matrix is not None else self.settings.matrix_path

    def unknown_names_message(self) -> str | None:
        """The warning for DISABLE/ENABLE names that no patch of the matrix has."""
        return self.settings.unknown_names_message(set(self.matrix.patches)) if self.matrix is not None else None
