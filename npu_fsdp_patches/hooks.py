"""Post-import hooks on top of wrapt, with the error isolation wrapt does not give.

wrapt calls hooks inside the user's ``import`` with no try/except (docs/design.md#71-wrapt-post-import-hooks),
so an exception in a hook would fail that import. Every hook registered here swallows and logs its
own errors; only ``PatchError``, which the runtime raises on purpose in strict mode, gets through.
"""
from __future__ import annotations

import logging
from types import ModuleType
from typing import Callable

from .errors import PatchError

log = logging.getLogger("npu_fsdp_patches")


def when_imported(module_name: str, callback: Callable[[ModuleType], None]) -> None:
    """Run ``callback(module)`` right after ``module_name`` finishes importing (or now, if it has)."""

    def hook(module: ModuleType) -> None:
        try:
            callback(module)
        except PatchError:
            raise
        except Exception:  # noqa: BLE001 - a hook must never break the user's import
            log.exception("npu_fsdp_patches: post-import hook for %s failed", module_name)

    import wrapt  # deferred: costs a third of activation and is needed only for pending targets

    wrapt.register_post_import_hook(hook, module_name)
