"""Find patch implementations: the built-ins, plus the ``npu_fsdp_patches.patches`` entry-point group.

The built-in patches register in that group through our own pyproject. Run from a plain checkout
(no installed metadata), the top-level ``patches/`` folder is mounted as ``npu_fsdp_patches.patches``
and its ``BUILTIN_PATCHES`` table stands in for the missing entry points.

Trust model: a patch runs inside the user's training step, so registering in the group is as powerful
as installing code. Built-ins always win: a third-party entry point that reuses a built-in's name is
ignored and reported, and a name registered by two third-party distributions is used from neither.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, NamedTuple

from . import dists

GROUP = "npu_fsdp_patches.patches"
BUILTIN_PACKAGE = "npu_fsdp_patches.patches"
OUR_DISTRIBUTION = "npu-fsdp-patches"


class Provider(NamedTuple):
    """Where a patch's code comes from: its entry-point value and the distribution that ships it."""

    value: str                  # "module:Class"
    distribution: str | None
    version: str | None
    builtin: bool

    def describe(self) -> str:
        where = f"{self.distribution or 'unknown distribution'} {self.version or '(unknown version)'}"
        return f"{where} (built-in)" if self.builtin else f"{where} (entry point {self.value})"

    def as_dict(self) -> dict:
        return self._asdict()


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


def discover() -> tuple:
    """(name -> Provider, name -> conflict message). Built-ins first; see the trust model above."""
    version = getattr(sys.modules.get("npu_fsdp_patches"), "__version__", None)
    builtins = builtin_table()
    providers = {name: Provider(value, OUR_DISTRIBUTION, version, True) for name, value in builtins.items()}
    offers: dict = {}
    for dist in dists.installed().values():
        for name, value in dist.entry_points(GROUP):
            if builtins.get(name) == value:   # our own registration of a built-in
                continue
            offers.setdefault(name, []).append(Provider(value, dist.name, dist.version, False))
    conflicts = {}
    for name, found in offers.items():
        if name in providers:
            conflicts[name] = (f"patch name {name!r} is built in ({providers[name].describe()}) but also "
                               f"registered by {', '.join(p.describe() for p in found)}; that registration "
                               "is ignored")
        elif len(found) > 1:
            conflicts[name] = (f"patch name {name!r} is registered by both {found[0].describe()} and "
                               f"{found[1].describe()}; neither is used")
        else:
            providers[name] = found[0]
    return providers, conflicts


def available() -> dict:
    """name -> Provider for every usable patch implementation."""
    return discover()[0]


def load_patch(value: str) -> Any:
    """Import "module:Class" and return an instance of the patch class."""
    if value.startswith(BUILTIN_PACKAGE):
        _mount_checkout_patches()
    module_name, _, attr = value.partition(":")
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj() if isinstance(obj, type) else obj
