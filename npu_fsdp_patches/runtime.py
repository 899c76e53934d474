"""Activation and the apply/revert lifecycle (docs/design.md#31-activation, #36-failure-policy): one Runtime
per process.

Locking: one RLock guards the runtime's state, but no patch code runs under it. Loading a patch, its
stand-down probe and its ``replacement()`` run outside the lock (as wrapt calls hooks), so they may
import, take their own locks or wait for threads that use the plugin; what they computed is committed
under the lock after a re-check that the targets did not change meanwhile (else it is computed again).
Post-import hooks are registered outside the lock too (wrapt runs hooks under its own lock).

Failure policy: a failing patch is logged once at WARNING and recorded as ``failed``; the other
patches go on. In strict mode (NPU_FSDP_PATCHES_STRICT=1), or for a patch named in
NPU_FSDP_PATCHES_ENABLE or passed to apply(), the failure raises PatchError instead, but only after
every other patch has been armed or applied: no failure disables another patch, in any mode.
"""
from __future__ import annotations

import os
import sys
import threading
from typing import Iterable, Mapping

from . import hooks, late_detection, loader, verify
from .decide import decide, requested_by_apply
from .detect import detect_all
from .errors import ConfigError, MatrixError, PatchError
from .matrix import Matrix, load_matrix
from .plugin_log import log
from .records import PatchRecord, State
from .registry import Registry, TargetNotFound, resolve
from .settings import PREFIX, Settings, parse_settings, strict_requested
from .stale import modules_referencing
from .summary import ActivationSummary

#: compute-then-commit rounds before a patch whose targets keep changing under it fails
_ATTEMPTS = 3


class _AtTarget(Exception):
    """Carries the target symbol whose installation failed; the cause is chained."""

    def __init__(self, symbol: str):
        super().__init__(symbol)
        self.symbol = symbol


def _unchanged(resolved: list) -> bool:
    """Every target still resolves to the owner and original it had (its module still imported)."""
    for item in resolved:
        if sys.modules.get(item.target.module) is None:
            return False
        try:
            now = resolve(item.target)
        except TargetNotFound:
            return False
        if now.owner is not item.owner or now.original is not item.original or now.had_own != item.had_own:
            return False
    return True


def _same(claims: list, again: list) -> bool:
    return len(claims) == len(again) and all(a.target == b.target and a.original is b.original
                                             for a, b in zip(claims, again))


def configure_logging(level: str | None) -> None:
    if level is None:
        return
    import logging
    logger = log.logger()
    logger.setLevel(level.upper())
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)


def _export_matrix_path(environ: Mapping[str, str], settings: Settings) -> None:
    """Give spawned workers the absolute matrix path: they may start after an ``os.chdir``."""
    key = f"{PREFIX}_MATRIX"
    if environ is os.environ and settings.matrix_path and environ.get(key) != settings.matrix_path:
        os.environ[key] = settings.matrix_path


class Runtime:
    """Holds settings, matrix, detection, per-patch records and the originals registry."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.activated = False
        self.settings = Settings()
        self.config_error: str | None = None
        self.matrix: Matrix | None = None
        self.frameworks: dict = {}
        self.records: dict = {}
        self.registry = Registry()
        self._implementations: dict = {}
        self.provider_conflicts: dict = {}   # patch name -> message (loader.discover)
        self._instances: dict = {}
        self._hooked: set = set()
        self._unregistered: list = []        # modules hooked under the lock, registered with wrapt after it
        self._probed: dict = {}              # patch name -> stand-down verdict (the first one computed wins)
        self._preimported: set = set()
        self._watched: dict = {}             # framework module -> frameworks not found at activation
        #: frameworks found after activation: framework, module, before, after (Detected.as_dict), patches
        self.late_detections: list = []
        self.summary = ActivationSummary()   # the NPU_FSDP_PATCHES_LOG=info line (summary.py)

    # -- activation -------------------------------------------------------------------------
    def activate(self, environ: Mapping[str, str] | None = None) -> None:
        """Read env, detect, evaluate the matrix and arm hooks; idempotent and re-entrant."""
        with self._lock:
            if self.activated:
                return
            self.activated = True
            environ = os.environ if environ is None else environ
            try:
                self.settings = parse_settings(environ)
            except ConfigError as exc:
                self._configuration_failed(exc, strict_requested(environ))
                return
            configure_logging(self.settings.log_level)
            for warning in self.settings.warnings:
                log.warning("%s", warning)
            _export_matrix_path(environ, self.settings)
            if not self.settings.active:
                log.info("%s=0: kill switch set, nothing registered or applied", PREFIX)
                return
            if not self._prepare():
                return
            self._warn_unknown_names()
            enabled = [r for r in self.records.values() if r.decision.enabled and r.state == State.PENDING]
            self._preimported = {m for r in enabled for m in self.matrix.patches[r.name].target_modules
                                 if hooks.imported(m)}
        failures = [f for record in enabled for f in self._arm(record.name)]   # patch code: no lock
        with self._lock:
            self._scan_stale([r.name for r in enabled])
        self.summary.update(self.snapshot)
        if failures:
            raise failures[0]

    def _configuration_failed(self, exc: PatchError, strict: bool) -> None:
        self.config_error = str(exc)
        log.error("npu_fsdp_patches inactive: %s", exc)
        if strict:
            raise exc

    def _prepare(self) -> bool:
        """Load matrix and detect frameworks once; build the records. False on a bad matrix."""
        if self.matrix is not None:
            return True
        try:
            matrix = load_matrix(self.settings.matrix_path)
            self._implementations, self.provider_conflicts = loader.discover()
            for name in matrix.patches:
                if name not in self._implementations and name not in self.provider_conflicts:
                    raise matrix.error(f"patches.{name}", f"unknown patch {name!r}: no implementation is "
                                       f"registered in entry-point group {loader.GROUP}")
        except MatrixError as exc:
            self._configuration_failed(exc, self.settings.strict)
            return False
        except Exception as exc:  # noqa: BLE001 - never let a surprise break the user's import
            self._configuration_failed(PatchError(f"cannot load the matrix: {type(exc).__name__}: {exc}"),
                                       self.settings.strict)
            return False
        self.matrix = matrix
        self.frameworks = detect_all(matrix.frameworks.values())
        for message in self.provider_conflicts.values():
            log.warning("%s", message)
        for name, spec in matrix.patches.items():
            decision = decide(spec, self.frameworks, self.settings)
            provider = self._implementations.get(name)
            record = PatchRecord(name, spec.summary, decision,
                                 [t.symbol + ("?" if t.optional else "") for t in spec.targets],
                                 state=State.PENDING if decision.enabled else State.DISABLED)
            record.provenance = provider.as_dict() if provider else None
            if provider is None:   # two third-party distributions claim the name: run neither
                record.error = self.provider_conflicts[name]
                record.state = State.FAILED if decision.enabled else record.state
            self.records[name] = record
            log.debug("patch %s %s: %s; code: %s", name, "enabled" if decision.enabled else "disabled",
                      decision.reason, provider.describe() if provider else record.error)
        self._watch_missing()
        return True

    def _watch_missing(self) -> None:
        """Watch the module of each gated framework not found now (late_detection.py)."""
        self._watched = late_detection.watched_modules(self.matrix, self.frameworks)
        for module in self._watched:
            hooks.when_looked_up(module, self._framework_looked_up)

    def _framework_looked_up(self, module: str) -> bool:
        """An import looks for a watched framework module: detect its frameworks again, decide again the
        patches they gate and arm those enabled now. True when none of them is left to watch."""
        with self._lock:
            names = self._watched.get(module, [])
            found = late_detection.detect_again(self.matrix, names, module)
            self._watched[module] = [n for n in names if n not in found]
            enabled: list = []
            for name, after in found.items():
                self.late_detections.append({"framework": name, "module": module, "enabled": enabled,
                                             "before": self.frameworks[name].as_dict(), "after": after.as_dict()})
                self.frameworks[name] = after
            if found:
                enabled += late_detection.decide_again(self.matrix, self.records, self.frameworks, self.settings,
                                                       self._implementations, list(found), module)
                log.info("%s found after activation (%s imported); enabled now: %s", ", ".join(found), module,
                         ", ".join(enabled) or "none")
        failures = [f for name in enabled for f in self._arm(name)]   # patch code: no lock
        with self._lock:
            self._scan_stale(enabled)
        if failures:
            raise failures[0]
        return not self._watched[module]

    def ensure_prepared(self) -> None:
        with self._lock:
            if self.matrix is None and self.config_error is None:
                self._prepare()

    def _warn_unknown_names(self) -> None:
        message = self.settings.unknown_names_message(set(self.matrix.patches))
        if message:
            log.warning("%s", message)

    # -- hooks and apply ----------------------------------------------------------------------
    def _arm(self, name: str) -> list:
        """Apply now for imported target modules; hook the others. Returns strict failures (PatchError)."""
        record = self.records[name]
        try:
            if not self._verified(record):
                return []
        except PatchError as exc:
            return [exc]
        with self._lock:
            modules = self.matrix.patches[name].target_modules
            record.waiting_for = [m for m in modules if not hooks.imported(m)]
            for module in record.waiting_for:
                self._hook(module)
            imported = [m for m in modules if m not in record.waiting_for]
        self._register_hooks()
        return self._apply_on_import((name, module) for module in imported)

    def _apply_on_import(self, pairs) -> list:
        """:meth:`on_import` for each (patch, module) pair; the PatchErrors it raised, in order."""
        failures = []
        for patch, module in pairs:
            try:
                self.on_import(patch, module)
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
            with self._lock:
                self._fail(record, exc, None)
            return False
        return True

    def code_problems(self, name: str) -> list:
        """How the code registered for ``name`` disagrees with its matrix entry (raises when the code
        cannot be loaded); importing the patch module imports no target."""
        return verify.problems(self.matrix.patches[name], self._instance(name))

    def _hook(self, module: str) -> None:
        """One post-import hook per module, for every patch with a target there (wrapt stops at the
        first hook that raises, so one hook per patch let a strict failure disarm the others).
        Called under the lock; :meth:`_register_hooks` hands it to wrapt once the lock is released."""
        if module not in self._hooked:
            self._hooked.add(module)
            self._unregistered.append(module)

    def _register_hooks(self) -> None:
        """Register the pending hooks with wrapt, outside our lock: wrapt calls a hook at once, under its
        own lock, when the module is imported meanwhile, and its hooks take our lock."""
        with self._lock:
            modules, self._unregistered = self._unregistered, []
        for module in modules:
            hooks.when_imported(module, self._module_imported)

    def _module_imported(self, module) -> None:
        name = module.__name__
        with self._lock:
            self._hooked.discard(name)
            touched = [patch for patch, record in self.records.items()
                       if record.state in (State.PENDING, State.APPLIED)
                       and name in self.matrix.patches[patch].target_modules]
        failures = self._apply_on_import((patch, name) for patch in touched)
        with self._lock:
            self._scan_stale(touched)
            if failures:   # raising fails this import, and importlib drops the module: re-arm for a retry
                self._module_discarded(name)
        self._register_hooks()
        self.summary.update(self.snapshot)
        if failures:
            raise failures[0]

    def _module_discarded(self, module: str) -> None:
        """Patches applied on a module object that leaves sys.modules go back to pending on it."""
        sys.modules.pop(module, None)
        for record in self.records.values():
            gone = [s for s in record.applied_targets if s.split(":")[0] == module]
            for symbol in gone:
                self.registry.forget(symbol)
                record.applied_targets.remove(symbol)
            if gone and not record.applied_targets:
                record.state = State.PENDING
            if gone and module not in record.waiting_for:
                record.waiting_for.append(module)
        self._hook(module)

    def _instance(self, name: str):
        """The patch object; loading it imports the patch's module (its code), so no lock is held."""
        with self._lock:
            patch, value = self._instances.get(name), self._implementations[name].value
        if patch is None:
            patch = loader.load_patch(value)
            with self._lock:
                patch = self._instances.setdefault(name, patch)
        return patch

    def on_import(self, name: str, module_name: str) -> None:
        """Apply ``name``'s targets that live in ``module_name`` (called once it is imported).

        Patch code runs with the lock released: load and probe, then (under the lock) resolve and claim
        the targets, then build the replacements, then (under the lock) install them if the targets
        and claims are still what they were built from, else build again.
        """
        record = self.records[name]
        try:
            for _ in range(_ATTEMPTS):
                with self._lock:
                    if record.state not in (State.PENDING, State.APPLIED):
                        return
                    spec = self.matrix.patches[name]
                    record.waiting_for = [m for m in spec.target_modules if not hooks.imported(m)]
                patch = self._instance(name)
                if self._stood_down(record, patch, spec):
                    return
                with self._lock:
                    if record.state not in (State.PENDING, State.APPLIED):
                        return
                    resolved = self._resolve(record, spec, module_name)
                    claims = self._claims(record, resolved)
                built = self._build(patch, claims)
                with self._lock:
                    if record.state not in (State.PENDING, State.APPLIED):
                        return
                    if _unchanged(resolved) and _same(claims, self._claims(record, resolved)):
                        self._install(record, claims, built, module_name)
                        return
            raise PatchError(f"its targets in {module_name} kept changing while it was applied "
                             f"({_ATTEMPTS} attempts)")
        except _AtTarget as failure:
            with self._lock:
                self._fail(record, failure.__cause__, failure.symbol)
        except Exception as exc:  # noqa: BLE001 - failure isolation per patch
            with self._lock:
                self._fail(record, exc, None)

    def _stood_down(self, record: PatchRecord, patch, spec) -> bool:
        """Run the stand-down probe once per apply (outside the lock); True when upstream has the fix."""
        probe = spec.stand_down_probe
        if not probe:
            return False
        with self._lock:
            verdict = self._probed.get(record.name)
        if verdict is None:
            verdict = bool(getattr(patch, probe)())   # verify.problems checked it exists
        with self._lock:
            verdict = self._probed.setdefault(record.name, verdict)
            if verdict and record.state in (State.PENDING, State.APPLIED) and not record.applied_targets:
                record.state, record.note = State.SKIPPED, f"upstream has it (probe {probe})"
                log.info("patch %s skipped: upstream has it", record.name)
        return verdict

    def _resolve(self, record: PatchRecord, spec, module_name: str) -> list:
        """The targets of ``spec`` in ``module_name``, found in the imported module (under the lock)."""
        resolved = []
        for target in (t for t in spec.targets if t.module == module_name):
            try:
                clash = self.registry.overlap(record.name, target)
                if clash:
                    raise PatchError(f"{clash}; two patches cannot change the same object")
                resolved.append(resolve(target))
            except TargetNotFound as exc:
                if not target.optional:
                    raise _AtTarget(target.symbol) from exc
            except PatchError as exc:
                raise _AtTarget(target.symbol) from exc
        return resolved

    def _claims(self, record: PatchRecord, resolved: list) -> list:
        """The resolved targets to install, each with the original its replacement must wrap (under the
        lock); a target another patch holds raises."""
        claims = []
        for item in resolved:
            holder = self.registry.holder(item.original) if item.had_own else None  # inherited: wrap the base
            if holder is not None and holder.patch != record.name:
                raise _AtTarget(item.target.symbol) from PatchError(
                    f"{item.target.symbol} holds the replacement that {holder.patch} installed at "
                    f"{holder.resolved.target.symbol}; two patches cannot change the same object")
            if self.registry.is_ours(item):
                continue
            if item.had_own:  # an inherited attribute is the base's live behaviour: keep it wrapped
                item = item._replace(original=self.registry.underlying(item.original))
            claims.append(item)
        return claims

    @staticmethod
    def _build(patch, claims: list) -> list:
        """The replacements, built by the patch's code outside the lock."""
        built = []
        for item in claims:
            try:
                built.append(patch.replacement(item.target.symbol, item.original))
            except Exception as exc:
                raise _AtTarget(item.target.symbol) from exc
        return built

    def _install(self, record: PatchRecord, claims: list, built: list, module_name: str) -> None:
        done, item = [], None
        try:
            for item, replacement in zip(claims, built):
                self.registry.install(record.name, item, replacement)
                done.append(item)
        except Exception as exc:
            for installed in reversed(done):
                self.registry.restore(installed.target.symbol)
            raise _AtTarget(item.target.symbol) from exc
        for item in done:
            if item.target.symbol not in record.applied_targets:
                record.applied_targets.append(item.target.symbol)
        if done:
            log.info("patch %s applied at %s; code: %s", record.name,
                     ", ".join(item.target.symbol for item in done), self._provenance(record.name))
        if module_name in self._preimported and module_name not in record.imported_before_activation:
            record.imported_before_activation.append(module_name)
        if record.applied_targets:
            record.state = State.APPLIED
        elif not record.waiting_for:
            raise PatchError("none of the optional targets exist: " + ", ".join(record.targets))

    def _provenance(self, name: str) -> str:
        provider = self._implementations.get(name)
        return provider.describe() if provider else "unknown"

    def _scan_stale(self, names: list) -> None:
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

    def _fail(self, record: PatchRecord, exc: Exception, symbol: str | None) -> None:
        cause = str(exc) if isinstance(exc, (TargetNotFound, PatchError)) else f"{type(exc).__name__}: {exc}"
        record.state, record.error = State.FAILED, cause
        log.warning("patch %s failed: %s", record.name, cause)
        if self.settings.strict or record.decision.explicit:
            raise PatchError(f"patch {record.name} failed at {symbol or record.name}: {cause}",
                             patch=record.name, target=symbol) from exc

    # -- public operations ----------------------------------------------------------------------
    def apply(self, names: Iterable[str]) -> list:
        with self._lock:
            if not self.settings.active:
                raise PatchError(f"{PREFIX}=0 (kill switch) is set; nothing is applied")
            self.ensure_prepared()
            if self.matrix is None:
                raise PatchError(f"npu_fsdp_patches is inactive: {self.config_error}")
            names = list(names) or [n for n, r in self.records.items() if r.decision.enabled]
            self._check_known(names)
            todo, refused = [], None
            for name in names:
                record = self.records[name]
                if name not in self._implementations:
                    refused = PatchError(f"patch {name} cannot be applied: {record.error}", patch=name)
                    break   # the names before it are still armed, as they always were
                self._check_live(record)
                if record.state == State.APPLIED:
                    continue
                record.decision = requested_by_apply(self.matrix.patches[name], self.frameworks)
                record.state, record.error, record.note = State.PENDING, None, None
                self._probed.pop(name, None)
                todo.append(name)
        self._register_hooks()
        failures = [f for name in todo for f in self._arm(name)]   # patch code: no lock
        self.summary.update(self.snapshot)
        if refused is not None:
            raise refused
        with self._lock:
            self._scan_stale(names)
            if failures:
                raise failures[0]
            return [self.records[n].as_dict() for n in names]

    def revert(self, names: Iterable[str]) -> list:
        with self._lock:
            self.ensure_prepared()
            names = list(names) or [n for n in self.records if self.registry.installed_for(n)
                                    or self.records[n].state == State.PENDING]
            self._check_known(names)
            refused = []
            for name in names:
                record = self.records[name]
                installed = self.registry.installed_for(name)
                if not installed and record.state != State.PENDING:
                    continue   # never applied: nothing to restore, the state stays true
                stacked = [why for s in installed if (why := self.registry.stacked_on(s))]
                if stacked:    # a foreign wrapper on ours: keep ours applied beneath it, say who
                    record.note = f"revert refused: {'; '.join(stacked)}"
                    refused.append(f"patch {name} not reverted: {'; '.join(stacked)}")
                    log.warning("%s", refused[-1])
                    continue
                errors = [e for s in installed if (e := self.registry.restore(s))]
                record.state, record.applied_targets, record.stale_refs = State.REVERTED, [], {}
                record.error = "; ".join(errors) or None
                log.info("patch %s reverted%s", name, f" ({record.error})" if record.error else "")
            if refused:
                raise PatchError("; ".join(refused), patch=names[0] if len(names) == 1 else None)
            return [self.records[n].as_dict() for n in names]

    def _check_known(self, names: list) -> None:
        unknown = [n for n in names if n not in self.records]
        if unknown:
            raise PatchError(f"unknown patch(es) {', '.join(unknown)}; known patches: "
                             f"{', '.join(sorted(self.records))}")

    def _check_live(self, record: PatchRecord) -> None:
        """Make an ``applied`` record match the live targets (reload, overwrite, dropped module)."""
        if record.state != State.APPLIED:
            return
        lost = {}
        for symbol in list(record.applied_targets):
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
                record.applied_targets.remove(symbol)
            record.state = State.FAILED
            now = "; ".join(f"{symbol} now holds {what}" for symbol, what in lost.items())
            record.error = (f"no longer installed at {', '.join(lost)} (module reloaded or attribute replaced "
                            f"after apply: {now}); npu_fsdp_patches.apply({record.name!r}) applies it again")
            log.warning("patch %s: %s", record.name, record.error)

    def snapshot(self) -> list:
        """The status records as they are now (no liveness re-check, no hook registration)."""
        with self._lock:
            return [r.as_dict() for r in self.records.values()]

    def provider(self, name: str):
        """The loader.Provider whose code implements ``name``; None on a provider conflict."""
        return self._implementations.get(name)

    def status(self) -> list:
        with self._lock:
            self.ensure_prepared()
            for record in self.records.values():
                self._check_live(record)
            records = [r.as_dict() for r in self.records.values()]
        self._register_hooks()   # a module dropped from sys.modules is hooked again
        return records


RUNTIME = Runtime()
