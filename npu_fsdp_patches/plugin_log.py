"""The ``npu_fsdp_patches`` logger, without importing :mod:`logging` until a message can be seen.

Activation logs a debug line per patch. Where nothing has imported :mod:`logging` yet, nothing has
configured it either, so the root default (WARNING) would drop every debug and info message: those are
skipped without importing it, and a warning or error imports it and is logged as before. Where logging
is loaded (torch imports it, NPU_FSDP_PATCHES_LOG configures it, the user set it up) every call goes
to ``logging.getLogger("npu_fsdp_patches")`` unchanged.
"""
from __future__ import annotations

import sys

NAME = "npu_fsdp_patches"
_WARNING = 30


class PluginLog:
    """debug/info/warning/error/exception with ``logging.Logger``'s signatures."""

    @staticmethod
    def logger():
        import logging
        return logging.getLogger(NAME)

    def is_enabled_for(self, level: int) -> bool:
        """``Logger.isEnabledFor``, False below WARNING while nothing has loaded logging."""
        if level < _WARNING and "logging" not in sys.modules:
            return False
        return self.logger().isEnabledFor(level)

    def _log(self, level: int, msg: str, *args, **kwargs) -> None:
        if level < _WARNING and "logging" not in sys.modules:
            return
        self.logger().log(level, msg, *args, **kwargs)

    def log(self, level: int, msg: str, *args, **kwargs) -> None:
        """``Logger.log``: ``level`` as a number (10 DEBUG ... 50 CRITICAL)."""
        self._log(level, msg, *args, **kwargs)

    def debug(self, msg: str, *args, **kwargs) -> None:
        self._log(10, msg, *args, **kwargs)

    def info(self, msg: str, *args, **kwargs) -> None:
        self._log(20, msg, *args, **kwargs)

    def warning(self, msg: str, *args, **kwargs) -> None:
        self._log(_WARNING, msg, *args, **kwargs)

    def error(self, msg: str, *args, **kwargs) -> None:
        self._log(40, msg, *args, **kwargs)

    def exception(self, msg: str, *args, **kwargs) -> None:
        kwargs.setdefault("exc_info", True)
        self._log(40, msg, *args, **kwargs)


log = PluginLog()
