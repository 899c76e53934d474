"""The swap of a patch's targets, atomic with respect to other threads as far as Python allows.

A patch's replacements are built first (install.py); only the attribute swaps run inside
:func:`swap_guard`. On a GIL build the guard raises the interpreter's switch interval for those few
``setattr`` calls, so no other thread runs between the swaps of one module's targets (or of one
revert): a thread calling them sees all patched or none. Targets in different modules are applied
as each module is imported, so they are consistent per module. A free-threaded build (no GIL) gives
no such guarantee; the plugin's own bookkeeping stays under the lifecycle lock either way.
"""
from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Iterator

#: seconds: far longer than the swaps (tens of microseconds; the slow rebinding of ``from x import f``
#: copies runs after the guard), yet short: the hand-over on entry, or a block that releases the GIL
#: (a lock, I/O), lets another thread run at most this long before the swapper gets it back (60 s
#: stalled the swapper for minutes under a busy reader thread)
_LONG = 0.005
_nesting = threading.local()


@contextlib.contextmanager
def swap_guard() -> Iterator[None]:
    """Run the block without a thread switch (GIL builds); nests."""
    depth = getattr(_nesting, "depth", 0)
    if depth:
        _nesting.depth = depth + 1
        try:
            yield
        finally:
            _nesting.depth = depth
        return
    previous = sys.getswitchinterval()
    sys.setswitchinterval(_LONG)
    # A thread already waiting for the GIL timed its wait with the old interval and would still force
    # a switch mid-swap: hand the GIL over once, so every waiter's next wait reads the long interval
    # (and one that took the GIL now runs at most _LONG before this thread gets it back).
    time.sleep(0)
    _nesting.depth = 1
    try:
        yield
    finally:
        _nesting.depth = 0
        sys.setswitchinterval(previous)
