"""Child side of the plugin entries of tests/test_fault_injection.py: apply, revert, a patch applied as
its module is imported, and late detection, each with the N-th write to a target failed
(tests/fault_injection.py). Runs with the core_demo fixtures on the path and the demo matrix; the
demo patch ``demo_shout`` has two targets in one module (``greet`` and ``Engine.run``).

After any failure the targets are all original or all patched (never one of each), the import of the
target module never raises, and ``status()`` says what happened: a failure the plugin records rather
than raises (the on-import paths, under the failure policy) is raised here from the record, so the
harness sees the fault reach the caller.
"""
from __future__ import annotations

import importlib
import sys

from tests.fault_injection import Entry, check_entry, run_once

PATCH, MODULE = "demo_shout", "demo_target"
MODULE_PATCHES = ("demo_shout", "demo_child")   # every enabled patch with a target in MODULE


def _record() -> dict:
    import npu_fsdp_patches
    return {r["name"]: r for r in npu_fsdp_patches.status()}[PATCH]


def _patched(module) -> tuple[bool, bool]:
    return (hasattr(vars(module)["greet"], "__npu_fsdp_patch__"),
            hasattr(vars(module.Engine)["run"], "__npu_fsdp_patch__"))


def _handed() -> dict:
    module = importlib.import_module(MODULE)
    return {"module": module, "Engine": module.Engine}


def _reverted() -> dict:
    import npu_fsdp_patches
    npu_fsdp_patches.revert(PATCH)
    return _handed()


def _applied() -> dict:
    import npu_fsdp_patches
    npu_fsdp_patches.apply(PATCH)
    return _handed()


def _discarded() -> dict:
    """Reverted, the module dropped from sys.modules and the patch requested again: pending on its
    next import. Nothing is handed over yet (the import makes a new module object)."""
    import npu_fsdp_patches
    npu_fsdp_patches.revert(*MODULE_PATCHES)
    for name in [m for m in sys.modules if m == MODULE or m.startswith(MODULE + ".")]:
        del sys.modules[name]
    npu_fsdp_patches.apply(*MODULE_PATCHES)
    return {}


def _import_and_report(_handed: dict) -> None:
    """Import the target module (as a user would) and raise what the plugin recorded, if it failed."""
    try:
        module = importlib.import_module(MODULE)
    except Exception as exc:   # noqa: BLE001 - the import itself must never fail
        raise AssertionError(f"importing {MODULE} raised {type(exc).__name__}") from None
    patched = _patched(module)
    if patched[0] != patched[1]:
        raise AssertionError(f"{MODULE} is half patched: greet {patched[0]}, Engine.run {patched[1]}")
    import npu_fsdp_patches
    failed = [f"{r['name']}: {r['error']}" for r in npu_fsdp_patches.status() if r["state"] == "failed"]
    if failed:   # demo_shout, or another patch of the module (demo_child)
        raise RuntimeError(f"failed on import: {'; '.join(failed)}")
    record = _record()
    if record["state"] != "applied" or not all(patched):
        raise AssertionError(f"{PATCH} is {record['state']} with targets patched {patched}")


def _call(action: str):
    def call(_handed: dict) -> None:
        import npu_fsdp_patches
        getattr(npu_fsdp_patches, action)(PATCH)
    return call


ENTRIES = [
    Entry("apply: two targets in one module", _reverted, _call("apply")),
    Entry("revert: two targets in one module", _applied, _call("revert")),
    Entry("apply as the module is imported", _discarded, _import_and_report),
]


def check(name: str, mode: str) -> int:
    """Run the harness over one entry in this process; the writes of a clean call."""
    return check_entry(next(e for e in ENTRIES if e.name == name), mode).writes


# ---- late detection: one process per injected write (a framework is found after activation once) ---
LATE = Entry("late detection: the framework put on sys.path after activation", dict, _import_and_report)


def late_once(late_site: str, n: int, mode: str) -> dict:
    """Activate without the framework, put it on sys.path, then import it with write ``n`` failed."""
    import npu_fsdp_patches  # noqa: F401 - activation sees no demo framework
    assert _record()["state"] == "disabled"
    sys.path.insert(0, late_site)
    fired, error = run_once(LATE, n, mode)
    return {"fired": fired, "error": None if error is None else repr(error)}


def check_without_rollback() -> None:
    """Negative control: with the registry's reinstall made a no-op, a revert failing at its second
    target leaves the first restored, and the harness must say so (it raises AssertionError)."""
    from npu_fsdp_patches.runtime import registry
    registry.Registry.reinstall = lambda self, symbol: None
    check_entry(ENTRIES[1], "before")
