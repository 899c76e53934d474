"""Collect what doctor reports as one JSON-ready dict (rendering lives in render.py).

Schema "npu-fsdp-patches/doctor" version 1 (documented in the README): plugin, environment,
frameworks, patches (the status() records), warnings, optional self_test, exit_code.
Anything that could crash or hang (importing torch or torch_npu) runs in a child interpreter.
"""
from __future__ import annotations

import importlib
import json
import platform
import subprocess
import sys

from . import __version__
from .detect import detect_framework, distribution_index
from .matrix import FrameworkSpec
from .runtime import RUNTIME
from .settings import PREFIX
from .torch_support import torch_findings

# The platform doctor always reports, whether or not the matrix names it (DESIGN §3.5).
_TORCH_NPU = FrameworkSpec("torch_npu", ("torch-npu",), "torch_npu")

SCHEMA = "npu-fsdp-patches/doctor"
SCHEMA_VERSION = 1
EXIT_OK, EXIT_PATCH_FAILED, EXIT_BAD_CONFIG = 0, 1, 2

_DEVICE_PROBE = """
import json, torch
acc = getattr(torch, "accelerator", None)
device = str(acc.current_accelerator()) if acc is not None and acc.is_available() else "cpu"
print(json.dumps({"torch": torch.__version__, "device": device}))
"""


def _child(code: str, timeout: float = 120) -> tuple:
    """Run code in a fresh interpreter; return (ok, stdout or the last line of the error)."""
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"timed out after {timeout}s"
    if proc.returncode == 0:
        return True, proc.stdout.strip()
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    return False, lines[-1] if lines else f"exit code {proc.returncode}"


def environment(try_import: bool) -> dict:
    torch_npu = RUNTIME.frameworks.get("torch_npu") or detect_framework(_TORCH_NPU, distribution_index())
    env = {"python": platform.python_version(), "platform": f"{sys.platform} {platform.machine()}",
           "torch": None, "device": None, "device_error": None,
           "torch_npu": {"installed": torch_npu.installed, "version": torch_npu.version,
                         "importable": None, "import_error": None}}
    ok, out = _child(_DEVICE_PROBE)
    if ok:
        env.update(json.loads(out.splitlines()[-1]))
    else:
        env["device_error"] = out
    if try_import and env["torch_npu"]["installed"]:
        ok, out = _child("import torch_npu")
        env["torch_npu"].update(importable=ok, import_error=None if ok else out)
    return env


def import_targets() -> list:
    """Import every enabled patch's target modules so their hooks fire here; return import errors."""
    errors = []
    for record in RUNTIME.records.values():
        if not record.decision.enabled:
            continue
        spec = RUNTIME.matrix.patches[record.name]
        for module in spec.target_modules:
            optional = all(t.optional for t in spec.targets if t.module == module)
            try:
                importlib.import_module(module)
            except ModuleNotFoundError:
                if not optional:   # an optional module belongs to another framework generation
                    errors.append(f"import {module}: not found")
            except Exception as exc:  # noqa: BLE001 - reported, never fatal
                errors.append(f"import {module}: {type(exc).__name__}: {exc}")
    return errors


def warnings_for(records: list) -> list:
    out = []
    for r in records:
        if r["decision"] == "enabled" and r["unverified"]:
            out.append(f"{r['name']}: {', '.join(r['unverified'])} in range but not verified by the test suite")
        for module in r["imported_before_activation"]:
            holders = sorted({m for refs in r["stale_refs"].values() for m in refs})
            text = f"{r['name']}: {module} was imported before npu_fsdp_patches activated"
            out.append(text + (f"; stale references to the unpatched objects in: {', '.join(holders)}"
                               if holders else "; no module holds a stale reference"))
    return out


def collect(*, try_import: bool = False, self_test: bool = False) -> dict:
    """The full doctor report; ``exit_code`` is 0 healthy, 1 a patch failed, 2 bad configuration."""
    RUNTIME.ensure_prepared()
    import_errors = import_targets() if try_import and RUNTIME.matrix is not None else []
    records = RUNTIME.status()
    settings = RUNTIME.settings
    report = {
        "schema": SCHEMA, "schema_version": SCHEMA_VERSION,
        "plugin": {"version": __version__, "active": settings.active and RUNTIME.config_error is None,
                   "matrix": RUNTIME.matrix.path if RUNTIME.matrix else settings.matrix_path,
                   "config_error": RUNTIME.config_error, "strict": settings.strict,
                   "disable": sorted(settings.disable) + (["*"] if settings.disable_all else []),
                   "enable": sorted(settings.enable)},
        "environment": environment(try_import),
        "frameworks": {n: d.as_dict() for n, d in RUNTIME.frameworks.items()},
        "patches": records,
        "warnings": (torch_findings(RUNTIME.frameworks.get("torch"), RUNTIME.matrix)
                     + warnings_for(records) + import_errors),
        "self_test": None,
    }
    if RUNTIME.matrix is not None:
        unknown = settings.unknown_names(set(RUNTIME.matrix.patches))
        if unknown:
            report["warnings"].append(f"{PREFIX}_DISABLE/ENABLE name unknown patch(es) {', '.join(unknown)}")
    if self_test:
        report["self_test"] = _self_test()
    failed = any(r["state"] == "failed" for r in records) or (
        report["self_test"] is not None and not report["self_test"].get("passed"))
    report["exit_code"] = (EXIT_BAD_CONFIG if RUNTIME.config_error else
                           EXIT_PATCH_FAILED if failed else EXIT_OK)
    return report


def _self_test() -> dict:
    try:
        from .optim.self_test import run_self_test
        return run_self_test()
    except Exception as exc:  # noqa: BLE001 - a broken self-test is a failed self-test
        return {"passed": False, "error": f"{type(exc).__name__}: {exc}"}
