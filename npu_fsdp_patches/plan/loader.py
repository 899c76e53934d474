"""Find patch implementations: the built-ins in ``patches/``, plus the ``npu_fsdp_patches.patches``
entry-point group for third-party patches.

A built-in is a ``Patch`` class that a module of ``npu_fsdp_patches.patches`` declares
(:mod:`.declarations`): adding the module adds the patch, no list names it. From a source checkout
the top-level ``patches/`` folder is mounted as that package. The table is read from the modules'
source and stored like the matrix (:func:`.matrix_cache.cached`), so activation parses nothing.

Trust model: a patch runs inside the user's training step, so registering in the group is as powerful
as installing code. Built-ins always win: a third-party entry point that reuses a built-in's name is
ignored and reported, and a name registered by two third-party distributions is used from neither.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, NamedTuple

from . import dists

GROUP = "npu_fsdp_patches.patches"
BUILTIN_PACKAGE = "npu_fsdp_patches.patches"
OUR_DISTRIBUTION = "npu-fsdp-patches"
#: the core files the built-in table is derived by
_READER_FILES = ("declarations.py", "loader.py")


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
    """Make ``npu_fsdp_patches.patches`` the patches/ of the same tree as this core: in a source checkout
    (an editable install included) the top-level patches/ folder next to the package is mounted as it,
    so a checkout on PYTHONPATH never runs the built-ins of another install."""
    here = Path(__file__).resolve().parent.parent   # the package root, npu_fsdp_patches/
    if BUILTIN_PACKAGE in sys.modules or (here / "patches" / "__init__.py").is_file():
        return   # installed: the subpackage imports as usual
    folder = here.parent / "patches"
    init = folder / "__init__.py"
    if not init.is_file():
        return
    spec = importlib.util.spec_from_file_location(BUILTIN_PACKAGE, init,
                                                  submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[BUILTIN_PACKAGE] = module
    spec.loader.exec_module(module)


def _builtin_path() -> list:
    """The folders of ``npu_fsdp_patches.patches`` (its ``__path__``); empty when there is none."""
    _mount_checkout_patches()
    try:
        return list(importlib.import_module(BUILTIN_PACKAGE).__path__)
    except (ImportError, AttributeError):
        return []


def builtin_declarations() -> list:
    """Every built-in patch class as its module declares it (:class:`.declarations.Declared`)."""
    from . import declarations  # pylint: disable=import-outside-toplevel  (ast: not on the activation path)

    return declarations.read_package(BUILTIN_PACKAGE, _builtin_path())


def _read_builtin_table() -> dict:
    return {d.name: d.value for d in builtin_declarations()}


def builtin_table() -> dict:
    """name -> "module:Class" of the patches shipped with the plugin (derived from ``patches/``)."""
    path = _builtin_path()
    stamp = _stamp(path)
    if stamp is None:
        return _read_builtin_table()
    from . import matrix_cache  # pylint: disable=import-outside-toplevel

    table = matrix_cache.cached("builtin_patches", stamp, _read_builtin_table)
    if not _only_builtin_modules(table, stamp, path):
        table = _read_builtin_table()       # a cache is data, never a source of module names
    return dict(table)


def _only_builtin_modules(table, stamp: tuple, path: list) -> bool:
    """Whether every "module:Class" of a stored table names one of the patch files the stamp lists (the
    package's own ``patches/``), so that a forged cache cannot make activation import another module."""
    own = {f"{BUILTIN_PACKAGE}.{name[:-3]}" for folder, name, *_ in stamp[1:] if folder in path}
    if not isinstance(table, dict):
        return False
    for name, value in table.items():
        if not (isinstance(name, str) and isinstance(value, str) and value.count(":") == 1):
            return False
        module, cls = value.split(":")
        if module not in own or not cls.isidentifier():
            return False
    return True


def _stamp(path: list) -> tuple | None:
    """What the built-in table depends on: Python, the reader's code and the patch sources (name, size,
    mtime); None where a folder cannot be listed (a zip): the sources are then read each time."""
    if not path:
        return None
    files = [(os.path.dirname(os.path.abspath(__file__)), name) for name in _READER_FILES]
    try:
        for folder in path:
            with os.scandir(folder) as entries:
                files += [(folder, e.name) for e in entries if e.name.endswith(".py")]
        stats = [(folder, name, os.stat(os.path.join(folder, name))) for folder, name in sorted(files)]
    except OSError:
        return None
    return (sys.version, *((folder, name, st.st_size, st.st_mtime_ns) for folder, name, st in stats))


def discover() -> tuple:
    """(name -> Provider, name -> conflict message). Built-ins first; see the trust model above."""
    version = getattr(sys.modules.get("npu_fsdp_patches"), "__version__", None)
    builtins = builtin_table()
    providers = {name: Provider(value, OUR_DISTRIBUTION, version, True) for name, value in builtins.items()}
    offers: dict = {}
    for dist in dists.installed().values():
        for name, value in dist.entry_points(GROUP):
            if builtins.get(name) == value:   # an older install of ours still registers its built-ins
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
