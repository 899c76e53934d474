"""Activation as pure steps (docs/design.md#31-activation): settings -> matrix -> detect -> decide.

:func:`load_sources` reads the matrix and the patch providers, :func:`make_plan` detects the installed
frameworks and decides every patch. Neither applies anything or registers a hook, so the lifecycle
(lifecycle.py) starts from one immutable :class:`Plan`; frameworks that appear later are
late_detection.py's.
"""
from __future__ import annotations

import os
from types import MappingProxyType
from typing import TYPE_CHECKING, Mapping

from ..errors import MatrixError, PatchError
from ..plan import loader
from ..plan.decide import decide
from ..plan.detect import detect_all
from ..plan.matrix import Matrix, load_matrix
from ..plan.settings import PREFIX, Settings
from ..plugin_log import log

if TYPE_CHECKING:
    from .job_log import JobLog


class _ReadOnly:
    """Fields set once at construction, read-only after. A NamedTuple would do, but creating each
    NamedTuple class costs activation several times what creating this one costs."""

    __slots__ = ()

    def __init__(self, **fields) -> None:
        if set(fields) != set(self.__slots__):
            raise TypeError(f"{type(self).__name__} takes exactly {', '.join(self.__slots__)}")
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(f"{type(self).__name__} is read-only")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is read-only")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{n}={getattr(self, n)!r}' for n in self.__slots__)})"


class PlanEntry(_ReadOnly):
    """One patch as activation decided it: name, spec (matrix.PatchSpec), decision (decide.Decision),
    provider (loader.Provider; None when two third-party distributions claim the name) and conflict
    (why there is no provider)."""

    __slots__ = ("name", "spec", "decision", "provider", "conflict")


class Sources(_ReadOnly):
    """What a plan is made from besides the frameworks: the matrix (matrix.Matrix), providers (patch
    name -> loader.Provider, every implementation discovered) and conflicts (patch name -> message,
    names that two distributions claim)."""

    __slots__ = ("matrix", "providers", "conflicts")


class Plan(_ReadOnly):
    """What activation found and decided: settings, matrix, frameworks (framework name ->
    detect.Detected, at activation), entries (a PlanEntry per patch, in matrix order), providers and
    conflicts (as in Sources). The mappings are read-only views."""

    __slots__ = ("settings", "matrix", "frameworks", "entries", "providers", "conflicts")

    def provider(self, name: str) -> loader.Provider | None:
        """The loader.Provider whose code implements ``name``; None on a provider conflict."""
        return self.providers.get(name)


def load_sources(settings: Settings) -> Sources:
    """The matrix the settings name and the patch providers (loader.discover).

    Raises MatrixError for a bad matrix and PatchError for any other surprise while loading, so
    activation can stay inactive without breaking the import."""
    try:
        matrix = load_matrix(settings.matrix_path)
        providers, conflicts = loader.discover()
    except MatrixError:
        raise
    except Exception as exc:  # noqa: BLE001 - never let a surprise break the user's import
        raise PatchError(f"cannot load the matrix: {type(exc).__name__}: {exc}")
    return Sources(matrix=matrix, providers=MappingProxyType(dict(providers)),
                   conflicts=MappingProxyType(dict(conflicts)))


def check_sources(sources: Sources) -> None:
    """Raise MatrixError for a patch of the matrix that no provider implements."""
    for name in sources.matrix.patches:
        if name not in sources.providers and name not in sources.conflicts:
            raise sources.matrix.error(f"patches.{name}", f"unknown patch {name!r}: no implementation is "
                                       f"registered in entry-point group {loader.GROUP}")


def make_plan(settings: Settings, sources: Sources, job: JobLog | None = None) -> Plan:
    """Detect the frameworks and decide every patch of ``sources``' matrix (checked by check_sources).
    The provider conflicts are warned through ``job`` (once per job), or here when there is none."""
    matrix, providers, conflicts = sources.matrix, sources.providers, sources.conflicts
    frameworks = detect_all(matrix.frameworks.values())
    for message in conflicts.values():
        if job is not None:
            job.config(30, message)
        else:
            log.warning("%s", message)
    entries = []
    for name, spec in matrix.patches.items():
        decision, provider = decide(spec, frameworks, settings), providers.get(name)
        entries.append(PlanEntry(name=name, spec=spec, decision=decision, provider=provider,
                                 conflict=None if provider else conflicts[name]))
        log.debug("patch %s %s: %s; code: %s", name, "enabled" if decision.enabled else "disabled",
                  decision.reason, provider.describe() if provider else conflicts[name])
    return Plan(settings=settings, matrix=matrix, frameworks=MappingProxyType(frameworks),
                entries=tuple(entries), providers=providers, conflicts=conflicts)


def configure_logging(level: str | None) -> None:
    """NPU_FSDP_PATCHES_LOG: the plugin logger's level, with a handler when none is set."""
    if level is None:
        return
    import logging
    logger = log.logger()
    logger.setLevel(level.upper())
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)


def announce(environ: Mapping[str, str], settings: Settings, job: JobLog) -> None:
    """The settings' side effects at activation: log level, their warnings (once per job), the exported
    matrix path."""
    configure_logging(settings.log_level)
    for warning in settings.warnings:
        job.config(30, warning)
    _export_matrix_path(environ, settings)


def _export_matrix_path(environ: Mapping[str, str], settings: Settings) -> None:
    """Give spawned workers the absolute matrix path: they may start after an ``os.chdir``."""
    key = f"{PREFIX}_MATRIX"
    if environ is os.environ and settings.matrix_path and environ.get(key) != settings.matrix_path:
        os.environ[key] = settings.matrix_path


def warn_unknown_names(settings: Settings, matrix: Matrix, job: JobLog) -> None:
    """One warning per job for DISABLE/ENABLE names that no patch of the matrix has."""
    message = settings.unknown_names_message(set(matrix.patches))
    if message:
        job.config(30, message)
