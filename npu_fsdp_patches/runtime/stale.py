"""Name the modules that still hold a pre-patch object (gevent's ``_find_module_refs`` idea)."""
from __future__ import annotations

import gc
import sys
from typing import Any


def modules_referencing(obj: Any, *, exclude: tuple = ()) -> list:
    """Modules whose globals bind ``obj`` directly, e.g. after ``from x import f`` ran before patching."""
    referrers = {id(r) for r in gc.get_referrers(obj) if isinstance(r, dict)}
    names = []
    for name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None)
        if namespace is not None and id(namespace) in referrers and name not in exclude:
            names.append(name)
    return sorted(names)


def rebind_module_refs(old: Any, new: Any) -> list:
    """Point module globals that still hold ``old`` at ``new``; return "module.name" of each rebind.

    Revert uses it so that copies made by ``from x import f`` *after* a patch was applied go back to
    the original too, and revert stays exact.
    """
    referrers = {id(r) for r in gc.get_referrers(old) if isinstance(r, dict)}
    rebound = []
    for module_name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None)
        if namespace is None or id(namespace) not in referrers:
            continue
        for name, value in list(namespace.items()):
            if value is old:
                namespace[name] = new
                rebound.append(f"{module_name}.{name}")
    return rebound
