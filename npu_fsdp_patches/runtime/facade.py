"""The per-process runtime (docs/design.md#31-activation): activate, apply, revert, status, snapshot.

A thin facade over three parts: activation.py turns the environment into an immutable plan,
lifecycle.py (with install.py) applies, hooks, checks and reverts the planned patches, and
late_detection.py decides again when a framework appears after activation. The locking protocol and
the failure policy are described in lifecycle.py. doctor and the CLI read :meth:`Runtime.snapshot`.
"""
from __future__ import annotations

import os
import threading
from types import MappingProxyType
from typing import TYPE_CHECKING, Iterable, Mapping

from ..errors import ConfigError, PatchError
from ..plan.settings import Settings, parse_settings, strict_requested
from ..plugin_log import log
from ..process_state import kept
from .activation import Plan, announce, check_sources, load_sources, make_plan, warn_unknown_names
from .job_log import JobLog
from .late_detection import LateDetection
from .lifecycle import Lifecycle, check_known
from .summary import ActivationSummary

if TYPE_CHECKING:
    from .snapshot import RuntimeSnapshot


class Runtime:
    """One per process: the settings, the plan, its lifecycle and the late detection."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.activated = False
        self.settings = Settings()
        self.config_error: str | None = None
        self._conflicts: Mapping = {}        # patch name -> message (loader.discover), kept on a bad matrix
        self._plan: Plan | None = None
        self._life: Lifecycle | None = None
        self._late: LateDetection | None = None
        self.job: JobLog | None = None       # which messages this process of the job says (job_log.py)
        self.summary = ActivationSummary()   # the NPU_FSDP_PATCHES_LOG=info line (summary.py)

    def activate(self, environ: Mapping[str, str] | None = None) -> None:
        """Read env, detect, evaluate the matrix and arm hooks; idempotent and re-entrant."""
        with self._lock:
            if self.activated:
                return
            self.activated = True
            environ = os.environ if environ is None else environ
            self.job = JobLog(environ)
            self.summary.owned = self.job.owns_summary
            try:
                self.settings = parse_settings(environ)
            except ConfigError as exc:
                self._configuration_failed(exc, strict_requested(environ))
                return
            announce(environ, self.settings, self.job)
            if not self.settings.active:
                self.job.config(20, f"{self.settings.kill_switch}: kill switch set, nothing registered or applied")
                return
            if not self._prepare():
                return
            warn_unknown_names(self.settings, self._plan.matrix, self.job)
            enabled = self._life.to_arm()
        failures = self._life.arm_all(enabled)   # patch code: no lock
        self._summarize()
        if failures:
            raise failures[0]

    def _configuration_failed(self, exc: PatchError, strict: bool) -> None:
        self.config_error = str(exc)
        message = f"npu_fsdp_patches inactive: {exc}"
        if self.job is not None:
            self.job.config(40, message)
        else:
            log.error("%s", message)
        if strict:
            raise exc

    def _prepare(self) -> bool:
        """Make the plan once and start its lifecycle and late detection. False on a bad matrix."""
        if self._plan is not None:
            return True
        try:
            sources = load_sources(self.settings)
            self._conflicts = sources.conflicts
            check_sources(sources)
        except PatchError as exc:   # MatrixError included
            self._configuration_failed(exc, self.settings.strict)
            return False
        self._plan = make_plan(self.settings, sources, self.job)
        self._life = Lifecycle(self._plan, self._lock, self.summary)
        self._late = LateDetection(self._life)
        self._late.watch()
        return True

    def ensure_prepared(self) -> None:
        """Make the plan if activation did not (kill switch): doctor, status and the CLI report it."""
        with self._lock:
            if self._plan is None and self.config_error is None:
                self._prepare()

    def _summarize(self) -> None:
        if self._life is not None:
            self.summary.update(self._life.record_dicts)

    def apply(self, names: Iterable[str]) -> list:
        """Apply ``names`` (every matrix-enabled patch if none) as an explicit request; their records."""
        with self._lock:
            if not self.settings.active:
                raise PatchError(f"{self.settings.kill_switch} (kill switch) is set; nothing is applied")
            self.ensure_prepared()
            life = self._life
            if life is None:
                raise PatchError(f"npu_fsdp_patches is inactive: {self.config_error}")
            names = list(names) or [n for n, r in life.records.items() if r.decision.enabled]
            check_known(names, life.records)
            todo, refused = life.request(names, self._late.frameworks)
        life.register_hooks()
        failures = [f for name in todo for f in life.arm(name)]   # patch code: no lock
        self._summarize()
        if refused is not None:
            raise refused
        with self._lock:
            life.scan_stale(names)
            if failures:
                raise failures[0]
            return [life.records[n].as_dict() for n in names]

    def revert(self, names: Iterable[str]) -> list:
        """Restore the originals of ``names`` (every applied or pending patch if none); their records."""
        with self._lock:
            self.ensure_prepared()
            if self._life is None:
                check_known(list(names), ())
                return []
            return self._life.revert(list(names))

    def status(self) -> list:
        """The status records, each checked against its live targets first."""
        with self._lock:
            self.ensure_prepared()
            if self._life is None:
                return []
            for record in self._life.records.values():
                self._life.check_live(record)
            records = self._life.record_dicts()
        self._life.register_hooks()   # a module dropped from sys.modules is hooked again
        return records

    def target_import_failed(self, name: str, error: str) -> None:
        """Fail pending patch ``name``: importing its target module raised ``error`` (doctor --import)."""
        with self._lock:
            if self._life is not None:
                self._life.target_import_failed(name, error)

    def snapshot(self) -> RuntimeSnapshot:
        """What doctor and the CLI report, as it is now (no liveness re-check, no hook registration)."""
        from .snapshot import RuntimeSnapshot   # not on the activation path: only readers pay for it
        with self._lock:
            late = self._late
            return RuntimeSnapshot(
                settings=self.settings, config_error=self.config_error,
                matrix=self._plan.matrix if self._plan is not None else None,
                frameworks=MappingProxyType(dict(late.frameworks) if late is not None else {}),
                records=tuple(self._life.record_dicts()) if self._life is not None else (),
                late_detections=tuple({**found, "enabled": list(found["enabled"])}
                                      for found in (late.found if late is not None else ())),
                provider_conflicts=MappingProxyType(dict(self._conflicts)))

    def provider(self, name: str):
        """The loader.Provider whose code implements ``name``; None on a provider conflict."""
        return self._plan.provider(name) if self._plan is not None else None

    def code_problems(self, name: str) -> list:
        """How the code registered for ``name`` disagrees with its matrix entry (verify.problems)."""
        return self._life.code_problems(name)


#: the one runtime of this process: a reload of this module gets the first one back (process_state.py)
RUNTIME: Runtime = kept("runtime", Runtime)
