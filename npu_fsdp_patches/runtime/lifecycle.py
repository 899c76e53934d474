"""The apply/revert lifecycle of the planned patches (docs/design.md#31-activation, #36-failure-policy).

Locking: one RLock guards the records, the registry and the hook bookkeeping, but no patch code runs
under it. Loading a patch, its stand-down probe and its ``replacement()`` run outside the lock (as
wrapt calls hooks), so they may import, take their own locks or wait for threads that use the plugin;
what they computed is committed under the lock after a re-check that the targets did not change
meanwhile (else it is computed again; install.py). Post-import hooks are registered outside the lock
too (wrapt runs hooks under its own lock).

Failure policy: a failing patch is logged once at WARNING and recorded as ``failed``; the other
patches go on. In strict mode (NPU_FSDP_PATCHES_STRICT=1), or for a patch named in
NPU_FSDP_PATCHES_ENABLE or passed to apply(), the failure raises PatchError instead, but only after
every other patch has been armed or applied: no failure disables another patch, in any mode.
"""
from __future__ import annotations

import sys
import threading
from typing import Iterable, Mapping

from ..errors import PatchError
from ..plan import loader
from ..plan.decide import requested_by_apply
from ..plugin_log import log
from . import hooks, verify
from .activation import Plan, PlanEntry
from .records import PatchRecord, State
from .registry import Registry, TargetNotFound
from .stale import modules_referencing
from .summary import ActivationSummary
from .swap import swap_guard


def _record(entry: PlanEntry) -> PatchRecord:
    """The status record a plan entry starts from: pending when enabled, failed when no code runs it."""
    spec, enabled = entry.spec, entry.decision.enabled
    record = PatchRecord(entry.name, spec.summary, entry.decision,
                         [t.symbol + ("?" if t.optional else "") for t in spec.targets],
                         state=State.PENDING if enabled else State.DISABLED)
    record.provenance = entry.provider.as_dict() if entry.provider else None
    if entry.provider is None:   # two third-party distributions claim the name: run neither
        if enabled:
            record.mark_failed(entry.conflict)
        else:
            record.error = entry.conflict
    return record


def check_known(names: list, known: Iterable[str]) -> None:
    """Raise PatchError for names that are no patch of the matrix in use."""
    unknown = [n for n in names if n not in known]
    if unknown:
        raise PatchError(f"unknown patch(es) {', '.join(unknown)}; known patches: {', '.join(sorted(known))}")


class Lifecycle:
    """The records of one plan and everything that moves them: hooks, apply, live checks, revert."""

    def __init__(self, plan: Plan, lock: threading.RLock, summary: ActivationSummary) -> None:
        self.plan, self.lock, self.summary = plan, lock, summary
        self.records = {entry.name: _record(entry) for entry in plan.entries}
        self.registry = Registry()
        self.preimported: set = set()        # target modules imported before activation
        self.probed: dict = {}               # patch name -> stand-down verdict (the first one computed wins)
        self._instances: dict = {}
        self._hooked: set = set()
        self._unregistered: list = []        # modules hooked under the lock, registered with wrapt after it

    def record_dicts(self) -> list:
        """The status records as they are now (no liveness re-check, no hook registration)."""
        with self.lock:
            return [r.as_dict() for r in self.records.values()]

    def to_arm(self) -> list:
        """Enabled patches still pending; remembers which of their target modules are imported already."""
        names = [n for n, r in self.records.items() if r.decision.enabled and r.state == State.PENDING]
        self.preimported = {m for n in names for m in self.plan.matrix.patches[n].target_modules
                            if hooks.imported(m)}
        return names

    def arm_all(self, names: list) -> list:
        """Arm each patch (patch code: no lock), then name stale references; the strict failures."""
        failures = [f for name in names for f in self.arm(name)]
        with self.lock:
            self.scan_stale(names)
        return failures

    # -- hooks ------------------------------------------------------------------------------------
    def arm(self, name: str) -> list:
        """Apply now for imported target modules; hook the others. Returns strict failures (PatchError)."""
        record = self.records[name]
        try:
            if not self._verified(record):
                return []
        except PatchError as exc:
            return [exc]
        with self.lock:
            modules = self.plan.matrix.patches[name].target_modules
            record.waiting_for = [m for m in modules if not hooks.imported(m)]
            for module in record.waiting_for:
                self._hook(module)
            imported = [m for m in modules if m not in record.waiting_for]
        self.register_hooks()
        return self._apply_on_import((name, module) for module in imported)

    def _apply_on_import(self, pairs) -> list:
        """:func:`install.apply_on_module` for each (patch, module) pair; the PatchErrors it raised."""
        from .install import apply_on_module   # once a target is imported: activation alone skips it
        failures = []
        for patch, module in pairs:
            try:
                apply_on_module(self, patch, module)
            except PatchError as exc:
                failures.append(exc)
        return failures

    def _verified(self, record: PatchRecord) -> bool:
        """Load the patch code and check it against the matrix from its declarations alone (no target
        is imported); a mismatch fails the patch under the failure policy."""
        try:
            found = self.code_problems(record.name)
            if found:
                raise PatchError("patch code does not match the matrix: " + "; ".join(found))
        except Exception as exc:  # noqa: BLE001 - failure isolation per patch
            with self.lock:
                self.fail(record, exc, None)
            return False
        return True

    def code_problems(self, name: str) -> list:
        """How the code registered for ``name`` disagrees with its matrix entry (raises when the code
        cannot be loaded); importing the patch module imports no target."""
        return verify.problems(self.plan.matrix.patches[name], self.instance(name))

    def instance(self, name: str):
        """The patch object; loading it imports the patch's module (its code), so no lock is held."""
        with self.lock:
            patch, value = self._instances.get(name), self.plan.providers[name].value
        if patch is None:
            patch = loader.load_patch(value)
            with self.lock:
                patch = self._instances.setdefault(name, patch)
        return patch

    def _hook(self, module: str) -> None:
        """One post-import hook per module, for every patch with a target there (wrapt stops at the
        first hook that raises, so one hook per patch let a strict failure disarm the others).
        Called under the lock; :meth:`register_hooks` hands it to wrapt once the lock is released."""
        if module not in self._hooked:
            self._hooked.add(module)
            self._unregistered.append(module)

    def register_hooks(self) -> None:
        """Register the pending hooks with wrapt, outside our lock: wrapt calls a hook at once, under its
        own lock, when the module is imported meanwhile, and its hooks take our lock."""
        with self.lock:
            modules, self._unregistered = self._unregistered, []
        for module in modules:
            hooks.when_imported(module, self._module_imported)

    def _module_imported(self, module) -> None:
        name = module.__name__
        with self.lock:
            self._hooked.discard(name)
            touched = [patch for patch, record in self.records.items()
                       if record.live and name in self.plan.matrix.patches[patch].target_modules]
        failures = self._apply_on_import((patch, name) for patch in touched)
        with self.lock:
            self.scan_stale(touched)
            if failures:   # raising fails this import, and importlib drops the module: re-arm for a retry
                self._module_discarded(name)
        self.register_hooks()
        self.summary.update(self.record_dicts)
        if failures:
            raise failures[0]

    def _module_discarded(self, module: str) -> None:
        """Patches applied on a module object that leaves sys.modules go back to pending on it: the
        next import of ``module`` is patched. Ours stays on the old object (classes defined there still
        call it) and revert restores it there too (registry.retire)."""
        sys.modules.pop(module, None)
        for record in self.records.values():
            gone = [s for s in record.applied_targets if s.split(":")[0] == module]
            for symbol in gone:
                self.registry.retire(symbol)
            if gone and self.registry.retired_for(record.name):
                record.note = (f"also installed on an earlier {module} module object that left sys.modules "
                               f"(code that imported it before still runs it); revert restores it there too")
            record.drop_targets(gone)
            if gone and not record.applied_targets:
                record.mark_pending(module)
            elif gone and module not in record.waiting_for:
                record.waiting_for.append(module)
        self._hook(module)

    def watch_for_reimport(self, module: str) -> None:
        """Once a patch is applied on ``module``, the next import that looks it up (it was deleted from
        sys.modules) marks its patches pending and hooks the new module object, so it is patched as it
        loads, with no status() call in between."""
        hooks.when_looked_up(module, self._looked_up_again)

    def _looked_up_again(self, module: str) -> bool:
        with self.lock:
            if hooks.imported(module):
                return False
            if any(s.split(":")[0] == module for r in self.records.values() for s in r.applied_targets):
                self._module_discarded(module)
        self.register_hooks()
        return True

    # -- outcomes ---------------------------------------------------------------------------------
    def fail(self, record: PatchRecord, exc: Exception, symbol: str | None) -> None:
        """Record the failure (under the lock); raise PatchError where the failure policy says so."""
        cause = str(exc) if isinstance(exc, (TargetNotFound, PatchError)) else f"{type(exc).__name__}: {exc}"
        record.mark_failed(cause)
        log.warning("patch %s failed: %s", record.name, cause)
        if self.plan.settings.strict or record.decision.explicit:
            raise PatchError(f"patch {record.name} failed at {symbol or record.name}: {cause}",
                             patch=record.name, target=symbol) from exc

    def target_import_failed(self, name: str, error: str) -> None:
        """A target module of ``name`` raised on import (doctor --import imports them): a patch still
        pending can never apply in this environment, so it fails with that error."""
        record = self.records[name]
        if record.state == State.PENDING:
            record.mark_failed(error)

    def scan_stale(self, names: list) -> None:
        """Name the modules that still hold an original, once every target of this round is patched
        (scanning per target listed the copies that the same round patches a moment later)."""
        for name in names:
            record = self.records[name]
            if record.state != State.APPLIED or not record.imported_before_activation:
                continue
            record.stale_refs = {}
            for symbol in record.applied_targets:
                if symbol.split(":")[0] in record.imported_before_activation:
                    refs = modules_referencing(self.registry.original(symbol))
                    if refs:
                        record.stale_refs[symbol] = refs

    def check_live(self, record: PatchRecord) -> None:
        """Make an ``applied`` record match the live targets (reload, overwrite, dropped module)."""
        if record.state != State.APPLIED:
            return
        lost = {}
        for symbol in list(record.applied_targets):
            if symbol not in record.applied_targets:
                continue   # its module was discarded for an earlier symbol of this loop
            how = self.registry.liveness(symbol)
            if how == "module gone":
                self._module_discarded(symbol.split(":")[0])
            elif how == "replaced":
                lost[symbol] = self.registry.replaced_by(symbol)
            elif self.registry.stacked_on(symbol):   # live beneath a foreign wrapper: say whose
                record.note = self.registry.stacked_on(symbol)
        if lost:
            for symbol in lost:
                self.registry.forget(symbol)
            record.drop_targets(list(lost))
            now = "; ".join(f"{symbol} now holds {what}" for symbol, what in lost.items())
            record.mark_failed(f"no longer installed at {', '.join(lost)} (module reloaded or attribute "
                               f"replaced after apply: {now}); npu_fsdp_patches.apply({record.name!r}) "
                               "applies it again")
            log.warning("patch %s: %s", record.name, record.error)

    # -- requests ---------------------------------------------------------------------------------
    def request(self, names: list, frameworks: Mapping) -> tuple:
        """apply(): each named record pending again, as an explicit request (under the lock).

        Returns (names to arm, PatchError refusing the first name without code, or None); the names
        before a refused one are still armed, as they always were."""
        todo = []
        for name in names:
            record = self.records[name]
            if name not in self.plan.providers:
                return todo, PatchError(f"patch {name} cannot be applied: {record.error}", patch=name)
            self.check_live(record)
            if record.state == State.APPLIED:
                continue
            record.request(requested_by_apply(self.plan.matrix.patches[name], frameworks))
            self.probed.pop(name, None)
            todo.append(name)
        return todo, None

    def _restore_all(self, name: str, installed: list) -> list:
        """Restore every target of ``name`` (live and retired), all or none: a restore that raises
        midway puts back the replacements already taken out, and the patch stays applied."""
        done: list = []
        try:
            with swap_guard():
                errors = []
                for symbol in installed:
                    error = self.registry.restore(symbol)
                    if error:
                        errors.append(error)   # someone replaced ours there: left alone
                    else:
                        done.append(symbol)
                errors += self.registry.restore_retired(name)
        except Exception as exc:
            with swap_guard():
                for symbol in reversed(done):
                    self.registry.reinstall(symbol)
            raise PatchError(f"patch {name} not reverted: {type(exc).__name__}: {exc}; every target still "
                             f"holds its replacement", patch=name) from exc
        finally:
            self.registry.rebind_copies()
        return errors

    def revert(self, names: list) -> list:
        """Restore the originals of the named patches (under the lock); their status records."""
        names = names or [n for n in self.records if self.registry.installed_for(n)
                          or self.records[n].state == State.PENDING]
        check_known(names, self.records)
        refused = []
        for name in names:
            record = self.records[name]
            installed = self.registry.installed_for(name)
            retired = self.registry.retired_for(name)
            if not installed and not retired and record.state != State.PENDING:
                continue   # never applied: nothing to restore, the state stays true
            stacked = [why for s in installed if (why := self.registry.stacked_on(s))]
            if stacked:    # a foreign wrapper on ours: keep ours applied beneath it, say who
                record.note = f"revert refused: {'; '.join(stacked)}"
                refused.append(f"patch {name} not reverted: {'; '.join(stacked)}")
                log.warning("%s", refused[-1])
                continue
            errors = self._restore_all(name, installed)
            if retired and not self.registry.retired_for(name):
                record.note = None
            record.mark_reverted("; ".join(errors) or None)
            log.info("patch %s reverted%s", name, f" ({record.error})" if record.error else "")
        if refused:
            raise PatchError("; ".join(refused), patch=names[0] if len(names) == 1 else None)
        return [self.records[n].as_dict() for n in names]
