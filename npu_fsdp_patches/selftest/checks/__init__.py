"""The self-test's checks, found in this package, in run order, and which apply to what is enabled.

A check is a module here with ``NAME``, ``ORDER`` (run order) and ``run(ctx) -> dict`` (figures;
``{"skipped": why}`` to stand down); one that verifies a patch also sets ``PATCH`` to its name and
runs only where the plugin enabled that patch. Adding a check touches nothing else. The declarations
are read from the modules' source, so importing this package imports no torch: the check modules
are imported by the ranks that run them.
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import pkgutil
from typing import Optional

_DECLARED = ("NAME", "ORDER", "PATCH")


def _declarations(module: str) -> dict:
    """The module-level ``NAME``/``ORDER``/``PATCH`` literals of ``module`` (without importing it)."""
    spec = importlib.util.find_spec(f"{__name__}.{module}")
    source = spec.loader.get_source(spec.name) if spec and spec.loader else None
    found = {}
    for node in ast.parse(source or "").body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                and node.targets[0].id in _DECLARED:
            found[node.targets[0].id] = ast.literal_eval(node.value)
    return found


def _discover() -> dict:
    found = {}
    for info in pkgutil.iter_modules(__path__):
        declared = _declarations(info.name)
        if "NAME" in declared and "ORDER" in declared:
            found[declared["NAME"]] = (declared["ORDER"], info.name, declared.get("PATCH"))
    return {name: (module, patch) for name, (_, module, patch) in sorted(found.items(), key=lambda kv: kv[1][0])}


#: name -> (module under npu_fsdp_patches.selftest.checks, the patch it verifies or None), in run order
CHECKS = _discover()


def why_not(name: str, records: dict) -> Optional[str]:
    """None when check ``name`` applies; else why not (shown as 'skipped'). ``records``: status() by name."""
    patch = CHECKS[name][1]
    if patch is None:
        return None
    record = records.get(patch)
    if record is None:
        return f"patch {patch} is not in the compatibility matrix"
    if record["decision"] != "enabled":
        return f"patch {patch} is {record['decision']}: {record['reason']}"
    return None


def load(name: str):
    """The check module (imports torch)."""
    return importlib.import_module(f"{__name__}.{CHECKS[name][0]}")
