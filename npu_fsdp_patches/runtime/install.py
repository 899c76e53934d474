"""Applying one patch's targets in one imported module: compute, then commit (docs/design.md#31-activation).

Patch code runs with the lifecycle's lock released: load the patch and run its stand-down probe, then
(under the lock) resolve and claim the targets, then build the replacements, then (under the lock)
install them if the targets and claims are still what they were built from, else build again, at most
:data:`ATTEMPTS` times. A failure goes to :meth:`Lifecycle.fail` (the failure policy).
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import PatchError
from ..plugin_log import log
from . import hooks
from .frames import skip_frames
from .records import PatchRecord
from .registry import Registry, TargetNotFound, resolve
from .swap import swap_guard

if TYPE_CHECKING:
    import threading

    from .activation import Plan
    from .summary import ActivationSummary


class Lifecycle(Protocol):
    """What installing needs of the lifecycle (``lifecycle.Lifecycle`` is the one implementation;
    this module imports it neither at run time nor for typing, so the two form no import cycle)."""

    plan: Plan
    lock: threading.RLock
    summary: ActivationSummary
    registry: Registry
    records: dict
    preimported: set
    probed: dict

    def instance(self, name: str) -> Any: ...

    def fail(self, record: PatchRecord, exc: Exception, symbol: str | None) -> None: ...

    def watch_for_reimport(self, module: str) -> None: ...


#: compute-then-commit rounds before a patch whose targets keep changing under it fails
ATTEMPTS = 3


class AtTarget(Exception):
    """Carries the target symbol whose installation failed; the cause is chained."""

    def __init__(self, symbol: str):
        super().__init__(symbol)
        self.symbol = symbol


def apply_on_module(life: Lifecycle, name: str, module_name: str) -> None:
    """Apply ``name``'s targets that live in ``module_name`` (called once it is imported)."""
    record = life.records[name]
    try:
        for _ in range(ATTEMPTS):
            with life.lock:
                if not record.live:
                    return
                spec = life.plan.matrix.patches[name]
                record.waiting_for = [m for m in spec.target_modules if not hooks.imported(m)]
            patch = life.instance(name)
            if _stood_down(life, record, patch, spec):
                return
            with life.lock:
                if not record.live:
                    return
                resolved = _resolve(life.registry, record, spec, module_name)
                claims = _claims(life.registry, record, resolved)
            built = _build(patch, claims)
            with life.lock:
                if not record.live:
                    return
                if _unchanged(resolved) and _same(claims, _claims(life.registry, record, resolved)):
                    _install(life, record, claims, built, module_name)
                    return
        raise PatchError(f"its targets in {module_name} kept changing while it was applied "
                         f"({ATTEMPTS} attempts)")
    except AtTarget as failure:
        with life.lock:
            life.fail(record, failure.__cause__, failure.symbol)
    except Exception as exc:  # noqa: BLE001 - failure isolation per patch
        with life.lock:
            life.fail(record, exc, None)


def _stood_down(life: Lifecycle, record: PatchRecord, patch, spec) -> bool:
    """Run the stand-down probe once per apply (outside the lock); True when upstream has the fix."""
    probe = spec.stand_down_probe
    if not probe:
        return False
    with life.lock:
        verdict = life.probed.get(record.name)
    if verdict is None:
        verdict = getattr(patch, probe)()   # verify.problems checked it exists
        verdict = verdict if isinstance(verdict, str) else bool(verdict)   # a str names the reason
    with life.lock:
        verdict = life.probed.setdefault(record.name, verdict)
        if verdict and record.live and not record.applied_targets:
            record.mark_skipped(verdict if isinstance(verdict, str) else f"upstream has it (probe {probe})")
            log.info("patch %s skipped: upstream has it", record.name)
    return verdict


def _resolve(registry: Registry, record: PatchRecord, spec, module_name: str) -> list:
    """The targets of ``spec`` in ``module_name``, found in the imported module (under the lock)."""
    resolved = []
    for target in (t for t in spec.targets if t.module == module_name):
        try:
            clash = registry.overlap(record.name, target)
            if clash:
                raise PatchError(f"{clash}; two patches cannot change the same object")
            resolved.append(resolve(target))
        except TargetNotFound as exc:
            if not target.optional:
                raise AtTarget(target.symbol) from exc
        except PatchError as exc:
            raise AtTarget(target.symbol) from exc
    return resolved


def _claims(registry: Registry, record: PatchRecord, resolved: list) -> list:
    """The resolved targets to install, each with the original its replacement must wrap (under the
    lock); a target another patch holds raises."""
    claims = []
    for item in resolved:
        holder = registry.holder(item.original) if item.had_own else None  # inherited: wrap the base
        if holder is not None and holder.patch != record.name:
            raise AtTarget(item.target.symbol) from PatchError(
                f"{item.target.symbol} holds the replacement that {holder.patch} installed at "
                f"{holder.resolved.target.symbol}; two patches cannot change the same object")
        if registry.is_ours(item):
            continue
        if item.had_own:  # an inherited attribute is the base's live behaviour: keep it wrapped
            item = item._replace(original=registry.underlying(item.original))
        claims.append(item)
    return claims


def _build(patch, claims: list) -> list:
    """The replacements, built by the patch's code outside the lock."""
    built = []
    for item in claims:
        try:
            replacement = patch.replacement(item.target.symbol, item.original)
            home = getattr(patch, "factory_globals", None)
            skip_frames(replacement, home(item.target.symbol) if home is not None else None)
            built.append(replacement)
        except Exception as exc:
            raise AtTarget(item.target.symbol) from exc
    return built


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


def _install(life: Lifecycle, record: PatchRecord, claims: list, built: list, module_name: str) -> None:
    """Commit the built replacements (under the lock); all or none of this module's targets."""
    done, item = [], None
    try:
        with swap_guard():   # the replacements were built before: only the swaps run here
            for item, replacement in zip(claims, built):
                life.registry.install(record.name, item, replacement)
                done.append(item)
    except Exception as exc:
        with swap_guard():
            for installed in reversed(done):
                life.registry.restore(installed.target.symbol)
        life.registry.rebind_copies()
        raise AtTarget(item.target.symbol) from exc
    if done:
        life.watch_for_reimport(module_name)
        provider = life.plan.provider(record.name)
        log.log(life.summary.detail_level(), "patch %s applied at %s; code: %s", record.name,
                ", ".join(item.target.symbol for item in done), provider.describe() if provider else "unknown")
    if module_name in life.preimported and module_name not in record.imported_before_activation:
        record.imported_before_activation.append(module_name)
    if done or record.applied_targets:
        record.mark_applied([item.target.symbol for item in done])
    elif not record.waiting_for:
        raise PatchError("none of the optional targets exist: " + ", ".join(record.targets))
