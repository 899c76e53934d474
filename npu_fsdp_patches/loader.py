"""Find patch implementations: the ``npu_fsdp_patches.patches`` entry-point group, plus a plain checkout.

The built-in patches register in that group through our own pyproject. Run from a plain checkout
(no installed metadata), the top-level ``patches/`` folder is mounted as ``npu_fsdp_patches.patches``
and its ``BUILTIN_PATCHES`` table stands in for the missing entry points.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from . import dists

GROUP = "npu_fsdp_patches.patches"
BUILTIN_PACKAGE = "npu_fsdp_patches.patches"


def _mount_checkout_patches() -> None:
    """Make ``npu_fsdp_patches.patches`` importable from a source checkout's top-level patches/."""
    if BUILTIN_PACKAGE in sys.modules or importlib.util.find_spec(BUILTIN_PACKAGE) is not None:
        return
    folder = Path(__file__).resolve().parent.parent / "patches"
    init = folder / "__init__.py"
    if not init.is_file():
        return
    spec = importlib.util.spec_from_file_location(BUILTIN_PACKAGE, init,
                                                  submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[BUILTIN_PACKAGE] = module
    spec.loader.exec_module(module)


def builtin_table() -> dict:
    """name -> "module:Class" of the patches shipped with the plugin."""
    _mount_checkout_patches()
    try:
        return dict(importlib.import_module(BUILTIN_PACKAGE).BUILTIN_PATCHES)
    except (ImportError, AttributeError):
        return {}


def available() -> dict:
    """name -> "module:attr" for every registered patch (entry points first, then built-ins)."""
    found = {}
    for name, value in dists.entry_points(GROUP):
        found.setdefault(name, value)
    for name, value in builtin_table().items():
        found.setdefault(name, value)
    return found


def load_patch(value: str) -> Any:
    """Import "module:Class" and return an instance of the patch class."""
    if value.startswith(BUILTIN_PACKAGE):
        _mount_checkout_patches()
    module_name, _, attr = value.partition(":")
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj() if isinstance(obj, type) else obj
