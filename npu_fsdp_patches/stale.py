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
