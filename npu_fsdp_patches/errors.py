"""Exceptions of the plugin. All derive from PatchError so callers can catch one type."""
from __future__ import annotations

from .process_state import kept


class PatchError(RuntimeError):
    """A patch could not be applied or reverted (raised only in strict mode or for explicit requests)."""

    def __init__(self, message: str, *, patch: str | None = None, target: str | None = None):
        super().__init__(message)
        self.patch = patch
        self.target = target


class ConfigError(PatchError):
    """An NPU_FSDP_PATCHES_* environment variable has a value outside its accepted set."""


class MatrixError(PatchError):
    """compat_matrix.yaml is malformed; the message names the file, key path and line."""

    def __init__(self, message: str, *, path: str = "", key_path: str = "", line: int | None = None):
        where = f"{path}" + (f":{line}" if line else "") + (f" at {key_path}" if key_path else "")
        super().__init__(f"{where}: {message}" if where else message)
        self.file = path
        self.key_path = key_path
        self.line = line


# A reload must not make new classes: ``except npu_fsdp_patches.PatchError`` has to catch what the
# process's one runtime raises, and that runtime was built by the first import (process_state.py).
PatchError, ConfigError, MatrixError = kept("errors", lambda: (PatchError, ConfigError, MatrixError))
