"""Activation and the apply/revert lifecycle (DESIGN §3.1, §3.6): one Runtime per process.

Failure policy: a failing patch is logged once at WARNING and recorded as ``failed``; the other
patches go on. In strict mode (NPU_FSDP_PATCHES_STRICT=1), or for a patch named in
NPU_FSDP_PATCHES_ENABLE or passed to apply(), the failure raises PatchError instead.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Iterable, Mapping

from . import hooks, loader
from .decide import Decision, decide, verification
from .detect import detect_all
from .errors import ConfigError, MatrixError, PatchError
from .matrix import Matrix, load_matrix
from .records import PatchRecord
from .registry import Registry, TargetNotFound, resolve
from .settings import PREFIX, Settings, parse_settings, strict_requested
from .stale import modules_referencing

log = logging.getLogger("npu_fsdp_patches")


class _AtTarget(Exception):
    """Carries the target symbol whose installation failed; the cause is chained."""

    def __init__(self, symbol: str):
        super().__init__(symbol)
        self.symbol = symbol


def configure_logging(level: str | None) -> None:
    if level is None:
        return
    log.setLevel(level.upper())
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)


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
        self._instances: dict = {}
        self._hooked: set = set()
        self._probed: set = set()
        self._preimported: set = set()

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
            if not self.settings.active:
                log.info("%s=0: kill switch set, nothing registered or applied", PREFIX)
                return
            if not self._prepare():
                return
            self._warn_unknown_names()
            enabled = [r for r in self.records.values() if r.decision.enabled]
            self._preimported = {m for r in enabled for m in self.matrix.patches[r.name].target_modules
                                 if m in sys.modules}
            for record in enabled:
                self._arm(record.name)

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
            self._implementations = loader.available()
            for name in matrix.patches:
                if name not in self._implementations:
                    raise matrix.error(f"patches.{name}", f"unknown patch {name!r}: no implementation is "
                                       f"registered in entry-point group {loader.GROUP}")
        except MatrixError as exc:
            self._configuration_failed(exc, self.settings.strict)
            return False
        self.matrix = matrix
        self.frameworks = detect_all(matrix.frameworks.values())
        for name, spec in matrix.patches.items():
            decision = decide(spec, self.frameworks, self.settings)
            self.records[name] = PatchRecord(name, spec.summary, decision,
                                             [t.symbol + ("?" if t.optional else "") for t in spec.targets],
                                             state="pending" if decision.enabled else "disabled")
        return True

    def ensure_prepared(self) -> None:
        with self._lock:
            if self.matrix is None and self.config_error is None:
                self._prepare()

    def _warn_unknown_names(self) -> None:
        unknown = self.settings.unknown_names(set(self.matrix.patches))
        if unknown:
            log.warning("%s_DISABLE/%s_ENABLE name unknown patch(es) %s; known patches: %s",
                        PREFIX, PREFIX, ", ".join(unknown), ", ".join(sorted(self.matrix.patches)))

    # -- hooks and apply ----------------------------------------------------------------------
    def _arm(self, name: str) -> None:
        """Apply now for imported target modules; register post-import hooks for the others."""
        record = self.records[name]
        modules = self.matrix.patches[name].target_modules
        record.waiting_for = [m for m in modules if m not in sys.modules]
        for module in modules:
            if module in sys.modules:
                self.on_import(name, module)
            elif (name, module) not in self._hooked:
                self._hooked.add((name, module))
                hooks.when_imported(module, lambda mod, _n=name: self._hook_fired(_n, mod))

    def _hook_fired(self, name: str, module) -> None:
        self._hooked.discard((name, module.__name__))
        self.on_import(name, module.__name__)

    def _instance(self, name: str):
        if name not in self._instances:
            self._instances[name] = loader.load_patch(self._implementations[name])
        return self._instances[name]

    def on_import(self, name: str, module_name: str) -> None:
        """Apply ``name``'s targets that live in ``module_name`` (called once it is imported)."""
        with self._lock:
            record = self.records[name]
            if record.state not in ("pending", "applied"):
                return
            spec = self.matrix.patches[name]
            record.waiting_for = [m for m in spec.target_modules if m not in sys.modules]
            symbol = None
            try:
                patch = self._instance(name)
                if spec.stand_down_probe and name not in self._probed:
                    self._probed.add(name)
                    probe = getattr(patch, spec.stand_down_probe, None)
                    if not callable(probe):
                        raise PatchError(f"stand-down probe {spec.stand_down_probe!r} is not defined by "
                                         f"{type(patch).__name__}")
                    if probe():
                        record.state, record.note = "skipped", f"upstream has it (probe {spec.stand_down_probe})"
                        log.info("patch %s skipped: upstream has it", name)
                        return
                resolved = []
                for target in (t for t in spec.targets if t.module == module_name):
                    symbol = target.symbol
                    try:
                        resolved.append(resolve(target))
                    except TargetNotFound:
                        if not target.optional:
                            raise
                symbol = None
                self._install(record, patch, resolved, module_name)
            except _AtTarget as failure:
                self._fail(record, failure.__cause__, failure.symbol)
            except Exception as exc:  # noqa: BLE001 - failure isolation per patch
                self._fail(record, exc, symbol)

    def _install(self, record: PatchRecord, patch, resolved: list, module_name: str) -> None:
        done, item = [], None
        try:
            for item in resolved:
                if self.registry.is_ours(item):
                    continue
                owner = self.registry.owner_patch(item.target.symbol)
                if owner not in (None, record.name):
                    raise PatchError(f"{item.target.symbol} is already patched by {owner}")
                if item.had_own:  # an inherited attribute is the base's live behaviour: keep it wrapped
                    item = item._replace(original=self.registry.underlying(item.original))
                self.registry.install(record.name, item, patch.replacement(item.target.symbol, item.original))
                done.append(item)
        except Exception as exc:
            for installed in reversed(done):
                self.registry.restore(installed.target.symbol)
            raise _AtTarget(item.target.symbol) from exc
        for item in done:
            if item.target.symbol not in record.applied_targets:
                record.applied_targets.append(item.target.symbol)
            if module_name in self._preimported:
                refs = modules_referencing(item.original, exclude=(module_name,))
                if refs:
                    record.stale_refs[item.target.symbol] = refs
        if module_name in self._preimported and module_name not in record.imported_before_activation:
            record.imported_before_activation.append(module_name)
        if record.applied_targets:
            record.state = "applied"
        elif not record.waiting_for:
            raise PatchError("none of the optional targets exist: " + ", ".join(record.targets))

    def _fail(self, record: PatchRecord, exc: Exception, symbol: str | None) -> None:
        cause = str(exc) if isinstance(exc, (TargetNotFound, PatchError)) else f"{type(exc).__name__}: {exc}"
        record.state, record.error = "failed", cause
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
            for name in names:
                record = self.records[name]
                if record.state == "applied":
                    continue
                spec = self.matrix.patches[name]
                _, unverified = verification(spec, self.frameworks, None)
                record.decision = Decision(True, "requested by apply()", True, not unverified, unverified)
                record.state, record.error, record.note = "pending", None, None
                self._probed.discard(name)
                self._arm(name)
            return [self.records[n].as_dict() for n in names]

    def revert(self, names: Iterable[str]) -> list:
        with self._lock:
            self.ensure_prepared()
            names = list(names) or [n for n in self.records if self.registry.installed_for(n)
                                    or self.records[n].state == "pending"]
            self._check_known(names)
            for name in names:
                record = self.records[name]
                errors = [e for s in self.registry.installed_for(name) if (e := self.registry.restore(s))]
                record.state, record.applied_targets = "reverted", []
                record.error = "; ".join(errors) or None
            return [self.records[n].as_dict() for n in names]

    def _check_known(self, names: list) -> None:
        unknown = [n for n in names if n not in self.records]
        if unknown:
            raise PatchError(f"unknown patch(es) {', '.join(unknown)}; known patches: "
                             f"{', '.join(sorted(self.records))}")

    def status(self) -> list:
        self.ensure_prepared()
        return [r.as_dict() for r in self.records.values()]


RUNTIME = Runtime()
