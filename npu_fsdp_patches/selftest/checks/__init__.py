"""The self-test's checks, in run order, and which apply to what is enabled.

Two sources. A standalone check (the ``optim`` numerics) is a module here with ``NAME``, ``ORDER``
(run order) and ``run(ctx) -> dict`` (figures; ``{"skipped": why}`` to stand down). A patch's check
is what the patch class declares in ``self_test`` (npu_fsdp_patches/patch.py), wherever its code
lives; it runs only where the plugin enabled that patch. Both are read from source
(:mod:`npu_fsdp_patches.plan.declarations`), so importing this package imports no torch: the check
modules are imported by the ranks that run them.
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import pkgutil
from typing import Callable, Optional

_DECLARED = ("NAME", "ORDER")


def _declarations(module: str) -> dict:
    """The module-level ``NAME``/``ORDER`` literals of ``module`` (without importing it)."""
    spec = importlib.util.find_spec(f"{__name__}.{module}")
    source = spec.loader.get_source(spec.name) if spec and spec.loader else None
    found = {}
    for node in ast.parse(source or "").body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                and node.targets[0].id in _DECLARED:
            found[node.targets[0].id] = ast.literal_eval(node.value)
    return found


def _standalone() -> dict:
    """name -> (order, "module:run", None) of the checks in this package."""
    found = {}
    for info in pkgutil.iter_modules(__path__):
        declared = _declarations(info.name)
        if "NAME" in declared and "ORDER" in declared:
            found[declared["NAME"]] = (declared["ORDER"], f"{__name__}.{info.name}:run", None)
    return found


def _declared_by_patches() -> dict:
    """name -> (order, "module:function", patch) of every known patch's declared ``self_test``."""
    from ...plan import declarations, loader  # pylint: disable=import-outside-toplevel

    found = {}
    for provider in loader.available().values():
        module = provider.value.partition(":")[0]
        for declared in declarations.read_module(module):
            if declared.self_test and provider.value == declared.value:
                test = declared.self_test
                found.setdefault(test["name"], (test["order"], test["run"], declared.name))
    return found


def _discover() -> dict:
    found = {**_declared_by_patches(), **_standalone()}   # a standalone check keeps its name
    return {name: (run, patch) for name, (_, run, patch) in sorted(found.items(), key=lambda kv: kv[1][0])}


#: name -> ("module:function" that runs it, the patch it verifies or None), in run order
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


def load(name: str) -> Callable:
    """The function that runs check ``name`` (importing its module imports torch)."""
    module, _, function = CHECKS[name][0].partition(":")
    return getattr(importlib.import_module(module), function)
