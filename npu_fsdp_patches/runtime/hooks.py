"""Post-import hooks on top of wrapt, with the error isolation wrapt does not give, and lookup hooks.

A lookup hook (``when_looked_up``) runs when an import first looks for a module, before it loads: late
detection needs only the ``sys.path`` of that moment, and it costs no wrapt import at activation.
Placeholder modules (MindSpeed's ``create_dummy``) never run a hook of ours.

wrapt calls hooks inside the user's ``import`` with no try/except (docs/design.md#71-wrapt-post-import-hooks),
so an exception in a hook would fail that import. Every hook registered here swallows and logs its
own errors; only ``PatchError``, which the runtime raises on purpose in strict mode, gets through.
"""
from __future__ import annotations

import sys
from types import ModuleType
from typing import Callable

from ..errors import PatchError
from ..plugin_log import log
from ..process_state import kept



def is_placeholder(module: object) -> bool:
    """A module object that no import made: no spec, or a spec without loader or search path.

    MindSpeed's patch manager registers such placeholders for missing frameworks
    (``mindspeed/patch_utils.py`` ``Patch.parse_path``: ``types.ModuleType(path)`` with
    ``ModuleSpec(path, None)``); a namespace package has a loader and search locations."""
    spec = getattr(module, "__spec__", None)
    return spec is None or (spec.loader is None and not spec.submodule_search_locations)


def imported(module_name: str) -> bool:
    """``module_name`` is in sys.modules as a module that an import made (not a placeholder)."""
    module = sys.modules.get(module_name)
    return module is not None and not is_placeholder(module)


def when_imported(module_name: str, callback: Callable[[ModuleType], None]) -> None:
    """Run ``callback(module)`` right after ``module_name`` finishes importing (or now, if it has).
    A placeholder module (:func:`is_placeholder`) never runs the callback."""

    def hook(module: ModuleType) -> None:
        if is_placeholder(module):
            log.debug("npu_fsdp_patches: %s is a placeholder module, not an import: no hook runs", module_name)
            return
        try:
            callback(module)
        except PatchError:
            raise
        except Exception:  # noqa: BLE001 - a hook must never break the user's import
            log.exception("npu_fsdp_patches: post-import hook for %s failed", module_name)

    import wrapt  # deferred: costs a third of activation and is needed only for pending targets

    wrapt.register_post_import_hook(hook, module_name)


class _FirstLookup:
    """A ``sys.meta_path`` entry that calls back when a watched top-level module is looked up, before
    any finder imports it, then steps aside (returns None) so the real finders do the import. At that
    moment ``sys.path`` is what the import will search, which is all detection needs; no wrapt."""

    def __init__(self) -> None:
        self.watched: dict = {}      # module name -> callback(name) -> True when done watching
        self._busy: set = set()      # names whose callback runs now (detection looks them up again)

    def find_spec(self, fullname: str, path=None, target=None):
        callback = self.watched.get(fullname)
        if callback is None or fullname in self._busy:
            return None
        self._busy.add(fullname)
        passed = list(sys.meta_path)
        try:
            if callback(fullname):
                self.watched.pop(fullname, None)
        except PatchError:
            raise
        except Exception:  # noqa: BLE001 - a lookup hook must never break the user's import
            log.exception("npu_fsdp_patches: lookup hook for %s failed", fullname)
        finally:
            self._busy.discard(fullname)
        return self._ask_new_finders(passed, fullname, path, target)

    def _ask_new_finders(self, passed: list, fullname: str, path, target):
        """The callback may have put a finder ahead of this one (wrapt's, for a post-import hook on
        this very module), or registered this module with a finder already there (wrapt's finder,
        installed once, answers only for modules with hooks); the import has already passed that
        place in sys.meta_path, so ask the finders ahead again here (one that said None before says
        None again unless the callback changed its mind). This entry never leaves sys.meta_path:
        removing it mid-lookup would skip the next finder."""
        del passed   # every finder ahead is asked: a passed one may answer now
        for finder in sys.meta_path:
            if finder is self:
                break
            find = getattr(finder, "find_spec", None)
            if find is not None:
                spec = find(fullname, path, target)
                if spec is not None:
                    return spec
        return None


_LOOKUPS = kept("lookups", _FirstLookup)   # the one in sys.meta_path, reloads included


def when_looked_up(module_name: str, callback: Callable[[str], bool]) -> None:
    """Call ``callback(module_name)`` each time ``module_name`` is looked up by an import that is not
    served from sys.modules (so never for a placeholder module), until it returns True."""
    _LOOKUPS.watched[module_name] = callback
    if _LOOKUPS not in sys.meta_path:
        sys.meta_path.insert(0, _LOOKUPS)
