"""What the plugin keeps once per interpreter, out of reach of a module reload (docs/design.md#31-activation).

``importlib.reload`` of a plugin module, or dropping the plugin's modules from ``sys.modules`` and
importing it again, runs the module code a second time: a module-level runtime would be built again
and would apply every patch a second time, on top of the first, with an originals registry that knows
only the second layer. So the objects that must be one per process (the runtime, which owns the
registry and the hooks, and the exception classes that callers catch) live in a dict on the ``sys``
module, which no reload of ours replaces; every later run of the module code gets the first ones back.
The first activation in a process stays in charge until the process exits.
"""
from __future__ import annotations

import sys
from typing import Any, Callable

#: the attribute of ``sys`` that holds the dict (one per interpreter; a fork inherits it with the patches)
ATTRIBUTE = "_npu_fsdp_patches_process_state"


def kept(name: str, make: Callable[[], Any]) -> Any:
    """The object kept under ``name`` for this process; ``make()`` builds it the first time only.

    Called while a plugin module executes, so the import lock serialises the first calls."""
    state = vars(sys).setdefault(ATTRIBUTE, {})
    if name not in state:
        state[name] = make()
    return state[name]
