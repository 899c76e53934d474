"""Originals registry: where each target lives, what was there before us, and how to put it back.

Modelled on gevent's ``monkey._state.saved``: the first original recorded for a target wins, so
applying twice never loses it, and revert is derived from the same records that apply wrote.
"""
from __future__ import annotations

import importlib
import sys
from typing import Any, NamedTuple

from ..plan.matrix import Target
from ..process_state import kept
from .stale import rebind_module_refs


class TargetNotFound(LookupError):
    """The framework no longer has the symbol (renamed, moved or removed)."""


TargetNotFound = kept("TargetNotFound", lambda: TargetNotFound)   # one class per process, reloads included


class Resolved(NamedTuple):
    target: Target
    owner: Any
    attr: str
    original: Any       # raw __dict__ entry for class attributes (never a bound method)
    had_own: bool       # False when a class inherits the attribute: revert deletes instead of setting


class Saved:
    """One installed replacement; ``installed`` turns False on revert, the original stays recorded."""

    def __init__(self, patch: str, resolved: Resolved, replacement: Any):
        self.patch, self.resolved, self.replacement, self.installed = patch, resolved, replacement, True


def resolve(target: Target) -> Resolved:
    """Find the owner object and raw attribute of ``target`` in the already imported module."""
    module = sys.modules.get(target.module) or importlib.import_module(target.module)
    owner: Any = module
    *path, attr = target.qualname.split(".")
    for part in path:
        if not hasattr(owner, part):
            raise TargetNotFound(f"target not found: {target.module}:{target.qualname}")
        owner = getattr(owner, part)
    if isinstance(owner, type):
        for klass in owner.__mro__:
            if attr in vars(klass):
                return Resolved(target, owner, attr, vars(klass)[attr], attr in vars(owner))
        raise TargetNotFound(f"target not found: {target.module}:{target.qualname}")
    if not hasattr(owner, attr):
        raise TargetNotFound(f"target not found: {target.module}:{target.qualname}")
    return Resolved(target, owner, attr, getattr(owner, attr), True)


def _chain(value: Any, depth: int = 16) -> list:
    """``value`` and what it wraps, outermost first, following ``__wrapped__`` (functools and wrapt)."""
    chain = []
    while value is not None and len(chain) < depth and not any(v is value for v in chain):
        chain.append(value)
        try:
            value = getattr(value, "__wrapped__", None)
        except Exception:  # noqa: BLE001 - an odd proxy ends the chain
            value = None
    return chain


def _wraps(value: Any, replacement: Any) -> bool:
    """``value`` is ``replacement``, or a wrapper (functools.wraps, wrapt) stacked on top of it."""
    return any(v is replacement for v in _chain(value))


def _above(value: Any, replacement: Any) -> list:
    """The foreign layers stacked on ``replacement``, outermost first (empty when it is ``value``).

    torch's own step-profiling wrapper (``Optimizer.profile_hook_step``, which ``Optimizer.__init__``
    puts around an un-hooked ``cls.step``) does not count: torch puts it around the restored original too.
    """
    chain = _chain(value)
    for index, layer in enumerate(chain):
        if layer is replacement:
            return [above for above in chain[:index] if not _torch_step_hook(above)]
    return []


def _torch_step_hook(layer: Any) -> bool:
    code = getattr(layer, "__code__", None)
    return (getattr(layer, "hooked", False) is True and code is not None
            and code.co_filename.replace("\\", "/").endswith("torch/optim/optimizer.py"))


def describe(obj: Any) -> str:
    """Where ``obj`` was really defined, as ``module.qualname``.

    A wrapper copies the name, qualified name and module of what it wraps (functools.wraps, wrapt), so
    those say nothing about who installed it: read the code object and the globals it was defined in.
    """
    wrapper = getattr(obj, "_self_wrapper", None)   # a wrapt FunctionWrapper: name the wrapper function
    if wrapper is not None:
        return f"wrapt {type(obj).__name__} calling {describe(wrapper)}"
    fn = getattr(obj, "__func__", obj)
    code = getattr(fn, "__code__", None)
    if code is not None:
        module = getattr(fn, "__globals__", {}).get("__name__", "?")
        return f"{module}.{getattr(code, 'co_qualname', code.co_name)} ({code.co_filename}:{code.co_firstlineno})"
    cls = type(obj)
    return f"a {cls.__module__}.{cls.__qualname__} object"


def _current(resolved: Resolved) -> Any:
    owner, attr = resolved.owner, resolved.attr
    if isinstance(owner, type):
        return vars(owner).get(attr)
    return getattr(owner, attr, None)


def _put(owner: Any, attr: str, value: Any) -> None:
    """The one write the plugin makes to a target: bind ``value`` at ``owner.attr`` (the fault-injection
    harness, tests/fault_injection.py, fails these one by one)."""
    setattr(owner, attr, value)


def _remove(owner: Any, attr: str) -> None:
    """The other write: drop ``owner.attr`` (the original was inherited, not the owner's own)."""
    delattr(owner, attr)


def _put_back(resolved: Resolved) -> None:
    if resolved.had_own:
        _put(resolved.owner, resolved.attr, resolved.original)
    else:
        _remove(resolved.owner, resolved.attr)


class Registry:
    """All installed replacements, keyed by target symbol; first original wins."""

    def __init__(self) -> None:
        self._saved: dict = {}
        #: entries installed on a module object that left sys.modules (deleted, then imported anew):
        #: code that imported it before (a class defined there) still runs ours, so revert restores it
        self._retired: list = []
        #: (replacement, original) whose ``from x import f`` copies still need rebinding: the scan is
        #: slow (gc), so it runs after all swaps of a revert, outside the swap guard
        self._rebinds: list = []

    def is_ours(self, resolved: Resolved) -> bool:
        """True when the live attribute is a replacement this registry installed."""
        entry = self._saved.get(resolved.target.symbol)
        return (entry is not None and entry.installed and entry.resolved.owner is resolved.owner
                and _wraps(_current(entry.resolved), entry.replacement))

    def install(self, patch: str, resolved: Resolved, replacement: Any) -> None:
        entry = self._saved.get(resolved.target.symbol)
        if entry is not None and entry.resolved.owner is resolved.owner and not entry.installed \
                and _current(entry.resolved) is entry.resolved.original:
            resolved = entry.resolved        # re-apply after revert: keep the first original
        try:
            _put(resolved.owner, resolved.attr, replacement)
        except BaseException:
            if _current(resolved) is replacement:   # bound, then failed (an owner's __setattr__): undone
                _put_back(resolved)
            raise
        self._saved[resolved.target.symbol] = Saved(patch, resolved, replacement)

    def restore(self, symbol: str) -> str | None:
        """Put the original back; return an error text when someone replaced our object since.

        A foreign wrapper stacked on ours is never dropped: :meth:`stacked_on` lets the caller refuse first.
        """
        entry = self._saved.get(symbol)
        if entry is None or not entry.installed:
            return None
        resolved = entry.resolved
        if not _wraps(_current(resolved), entry.replacement):
            return f"{symbol} was replaced by someone else after apply; left alone"
        if _above(_current(resolved), entry.replacement):
            raise RuntimeError(self.stacked_on(symbol))
        try:
            _put_back(resolved)
        except BaseException:
            if _current(resolved) is not entry.replacement:   # taken out, then failed: put back
                _put(resolved.owner, resolved.attr, entry.replacement)
            raise
        entry.installed = False
        self._rebinds.append((entry.replacement, resolved.original))
        return None

    def reinstall(self, symbol: str) -> None:
        """Undo :meth:`restore` of ``symbol`` (a revert that failed midway puts back what it took)."""
        entry = self._saved[symbol]
        _put(entry.resolved.owner, entry.resolved.attr, entry.replacement)
        entry.installed = True

    def rebind_copies(self) -> None:
        """Point module-level copies of replacements restored since the last call (``from x import
        f`` made after apply) at their originals. Call it after the swaps, outside the swap guard: it
        scans the heap, which is far too slow to keep other threads out for."""
        pending, self._rebinds = self._rebinds, []
        for replacement, original in pending:
            live = [*self._saved.values(), *self._retired]
            if not any(e.installed and e.replacement is replacement for e in live):
                rebind_module_refs(replacement, original)

    def stacked_on(self, symbol: str) -> str | None:
        """Why reverting ``symbol`` would drop a foreign wrapper stacked on our replacement, if one is.

        Python cannot rewire a wrapper to call something else (a functools.wraps closure or a wrapt
        proxy holds its own reference), so revert refuses and leaves ours applied beneath it.
        """
        entry = self._saved.get(symbol)
        if entry is None or not entry.installed:
            return None
        layers = _above(_current(entry.resolved), entry.replacement)
        if not layers:
            return None
        named = " over ".join(describe(layer) for layer in layers)
        return (f"{symbol} is wrapped by {named}, stacked on our replacement after apply; reverting would "
                f"silently remove that wrapper, so ours stays applied (remove the wrapper first, then revert)")

    def replaced_by(self, symbol: str) -> str:
        """What now sits at ``symbol`` instead of our replacement, and whether it wraps ours."""
        entry = self._saved[symbol]
        try:
            now = _current(resolve(entry.resolved.target))
        except (TargetNotFound, ImportError):
            return "nothing (the attribute is gone)"
        chain = _chain(now)
        if any(v is entry.replacement for v in chain):
            relation = "which wraps ours"
        elif any(v is entry.resolved.original for v in chain):
            relation = "which does not wrap ours: it wraps the original, so our replacement no longer runs"
        else:
            relation = "which does not wrap ours"
        return f"{describe(now)}, {relation}"

    def underlying(self, value: Any) -> Any:
        """The original behind ``value`` when ``value`` is one of our installed replacements.

        A module that ran ``from x import f`` after ``x.f`` was patched holds our replacement; patching
        that copy must wrap, and revert must restore, the real original, never our wrapper.
        """
        entry = self.holder(value)
        return entry.resolved.original if entry is not None and entry.replacement is value else value

    def holder(self, value: Any) -> Saved | None:
        """The installed entry whose replacement ``value`` is (or wraps), if any."""
        for entry in self._saved.values():
            if entry.installed and _wraps(value, entry.replacement):
                return entry
        return None

    def overlap(self, patch: str, target: Target) -> str | None:
        """Why ``target`` collides with another patch's installed target (same, inside or around it)."""
        for symbol, entry in self._saved.items():
            other = entry.resolved.target
            if not entry.installed or entry.patch == patch or other.module != target.module:
                continue
            if other.qualname == target.qualname:
                return f"{target.symbol} is already patched by {entry.patch}"
            if other.qualname.startswith(target.qualname + ".") or target.qualname.startswith(other.qualname + "."):
                return f"{target.symbol} overlaps {symbol}, which is already patched by {entry.patch}"
        return None

    def liveness(self, symbol: str) -> str:
        """"live", "module gone" (dropped from sys.modules) or "replaced" (reloaded or overwritten)."""
        entry = self._saved[symbol]
        if sys.modules.get(entry.resolved.target.module) is None:
            return "module gone"
        try:
            now = resolve(entry.resolved.target)
        except TargetNotFound:
            return "replaced"
        live = now.owner is entry.resolved.owner and _wraps(_current(now), entry.replacement)
        return "live" if live else "replaced"

    def retire(self, symbol: str) -> None:
        """The module object of ``symbol`` left sys.modules: keep our replacement there (code that
        holds the old object still runs it) and remember it for revert; a new module object of that
        name is patched as a new target."""
        entry = self._saved.pop(symbol, None)
        if entry is not None and entry.installed and _wraps(_current(entry.resolved), entry.replacement):
            self._retired.append(entry)

    def retired_for(self, patch: str) -> list:
        return [e.resolved.target.symbol for e in self._retired if e.patch == patch]

    def restore_retired(self, patch: str) -> list:
        """Put the originals back on the earlier module objects of ``patch``'s targets; the texts of
        what could not be restored (a foreign wrapper stacked on ours stays, as in :meth:`restore`)."""
        errors, kept, done = [], [], []
        try:
            self._restore_retired(patch, errors, kept, done)
        except BaseException:
            for entry in reversed(done):   # all or nothing, as for the live module's targets
                _put(entry.resolved.owner, entry.resolved.attr, entry.replacement)
                entry.installed = True
            raise
        self._retired = kept
        return errors

    def _restore_retired(self, patch: str, errors: list, kept: list, done: list) -> None:
        for entry in self._retired:
            if entry.patch != patch:
                kept.append(entry)
                continue
            current, resolved = _current(entry.resolved), entry.resolved
            if not _wraps(current, entry.replacement):
                continue   # someone replaced ours there since: nothing of ours to remove
            if _above(current, entry.replacement):
                errors.append(f"{resolved.target.symbol} (an earlier module object) is wrapped by "
                              f"{' over '.join(describe(x) for x in _above(current, entry.replacement))}; left alone")
                kept.append(entry)
                continue
            done.append(entry)   # before the write: a write that binds, then fails, is undone too
            _put_back(resolved)
            entry.installed = False
            self._rebinds.append((entry.replacement, resolved.original))

    def forget(self, symbol: str) -> None:
        """Mark an entry not installed without touching the target (its module object is gone)."""
        entry = self._saved.get(symbol)
        if entry is not None:
            entry.installed = False

    def owner_patch(self, symbol: str) -> str | None:
        """The patch whose replacement is installed at ``symbol`` now, if any."""
        entry = self._saved.get(symbol)
        return entry.patch if entry is not None and entry.installed else None

    def installed_for(self, patch: str) -> list:
        return [s for s, e in self._saved.items() if e.patch == patch and e.installed]

    def original(self, symbol: str) -> Any:
        """The original object recorded for ``symbol`` (like gevent's get_original)."""
        entry = self._saved.get(symbol)
        if entry is None:
            raise KeyError(symbol)
        return entry.resolved.original
