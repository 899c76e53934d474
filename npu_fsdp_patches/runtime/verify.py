"""Check a patch's code against its matrix entry from declarations alone (modelled on pluggy's
``_verify_hook``): before any target is imported, so a mismatch is reported at activation and by
doctor instead of surfacing only when the target module is imported.

Checked: the class's ``name`` is the matrix key; the named stand-down probe is a method callable
without arguments; every matrix target's attribute has a callable factory in ``factories``. Nothing
here imports a target or torch.
"""
from __future__ import annotations

from typing import Any

from ..patch import Patch, target_attribute
from ..plan.matrix import PatchSpec


def _where(patch: Any) -> str:
    cls = patch if isinstance(patch, type) else type(patch)
    return f"{cls.__module__}:{cls.__qualname__}"


def _required_arguments(method: Any) -> int | None:
    """Positional parameters a bound method still needs (None when it has no Python code to read)."""
    fn = getattr(method, "__func__", method)
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    bound = 1 if fn is not method else 0
    return code.co_argcount - len(getattr(fn, "__defaults__", None) or ()) - bound


def _probe_problems(spec: PatchSpec, patch: Any) -> list:
    name = spec.stand_down_probe
    probe = getattr(patch, name, None)
    if not callable(probe):
        return [f"stand-down probe {name!r} is not defined by {type(patch).__name__}"]
    needed = _required_arguments(probe)
    if needed:
        return [f"stand-down probe {name!r} of {_where(patch)} must take no arguments, it needs {needed}"]
    return []


def _declares(patch: Any) -> bool:
    """A class that overrides ``replacement()`` and declares no factories opts out of the target check."""
    cls = type(patch)
    return bool(getattr(cls, "factories", None)) or getattr(cls, "replacement", None) is Patch.replacement


def _target_problems(spec: PatchSpec, patch: Any) -> list:
    declared = dict(getattr(patch, "factories", None) or {})
    where, out = _where(patch), []
    for target in spec.targets:
        if target_attribute(target.symbol) not in declared:
            out.append(f"matrix target {target.symbol} has no factory in {where}.factories "
                       f"(declared: {', '.join(sorted(declared)) or 'none'})")
    for attr, factory in declared.items():
        if not callable(factory):
            out.append(f"{where}.factories[{attr!r}] is {type(factory).__name__}, not a factory")
    return out


def problems(spec: PatchSpec, patch: Any) -> list:
    """Every way ``patch`` (the loaded patch object) disagrees with its matrix entry ``spec``."""
    out = []
    name = getattr(patch, "name", None)
    if name != spec.name:
        out.append(f"{_where(patch)} declares name {name!r}, but is registered and listed in the matrix "
                   f"as {spec.name!r}")
    if spec.stand_down_probe:
        out += _probe_problems(spec, patch)
    if _declares(patch):
        out += _target_problems(spec, patch)
    return out
