"""Collect what doctor reports as one JSON-ready dict (rendering lives in render.py).

Schema "npu-fsdp-patches/doctor" version 1 (docs/cli.md#doctor-json-schema): plugin, environment,
frameworks, patches (the status() records), errors, warnings, optional self_test, exit_code.
Anything that could crash or hang (importing torch, torch_npu or the patch targets) runs in a child
interpreter with the user's environment.
"""
from __future__ import annotations

import importlib
import json
import os
import platform
import subprocess
import sys
import traceback
from typing import Mapping

from .. import __version__
from ..plan.detect import detect_framework, distribution_index, normalize
from ..plan.matrix import FrameworkSpec
from ..plan.settings import PREFIX, strict_requested
from ..plan.torch_support import torch_findings
from ..runtime.facade import RUNTIME
from ..runtime.snapshot import RuntimeSnapshot
from .detection_env import detection_environment

# The platform doctor always reports, whether or not the matrix names it (docs/design.md#35-status-and-doctor).
_TORCH_NPU = FrameworkSpec("torch_npu", ("torch-npu",), "torch_npu")
_TORCH = FrameworkSpec("torch", ("torch",), "torch")

SCHEMA = "npu-fsdp-patches/doctor"
SCHEMA_VERSION = 1
EXIT_OK, EXIT_PATCH_FAILED, EXIT_BAD_CONFIG = 0, 1, 2

#: the line a probe child prints its JSON result on (anything else on stdout is the child's noise)
_MARK = "NPU_FSDP_PATCHES_PROBE "
#: probe children print their result and leave with os._exit: a half-imported torch (a failed backend
#: autoload) can crash the interpreter's teardown, and that must not hide the result
_PROBE_PRELUDE = f"""
import json, os, sys
def emit(result):
    sys.stdout.write({_MARK!r} + json.dumps(result) + "\\n"); sys.stdout.flush(); os._exit(0)
def causes(exc):
    out = []
    while exc is not None and len(out) < 8:
        out.append(f"{{type(exc).__name__}}: {{exc}}")
        exc = exc.__cause__ or exc.__context__
    return out
"""
_DEVICE_PROBE = _PROBE_PRELUDE + """
try:
    import torch
except BaseException as exc:
    emit({"error": causes(exc)})
acc = getattr(torch, "accelerator", None)
device = str(acc.current_accelerator()) if acc is not None and acc.is_available() else "cpu"
emit({"torch": torch.__version__, "device": device})
"""
_TORCH_NPU_PROBE = _PROBE_PRELUDE + """
try:
    import torch_npu
except BaseException as exc:
    emit({"error": causes(exc)})
emit({})
"""
_FRAMEWORKS_PROBE = _PROBE_PRELUDE + """
import importlib
found = {}
for name, module in json.loads(sys.argv[1]).items():
    try:
        importlib.import_module(module)
        found[name] = None
    except BaseException as exc:
        found[name] = causes(exc)
emit(found)
"""
_TARGETS_PROBE = _PROBE_PRELUDE + """
import importlib.util
if importlib.util.find_spec("torch") is not None:   # the platform of every patch: first, and alone
    try:
        import torch
    except BaseException as exc:
        emit({"torch_error": causes(exc)})
import npu_fsdp_patches
from npu_fsdp_patches.cli.doctor import import_targets
errors = import_targets()
emit({"errors": errors, "patches": npu_fsdp_patches.status()})
"""

#: TORCH_DEVICE_BACKEND_AUTOLOAD as this process started: torch_npu turns it off while it imports
#: torch and restores it only when its import succeeds, so a failed import leaves it at 0
_AUTOLOAD = "TORCH_DEVICE_BACKEND_AUTOLOAD"
_START_AUTOLOAD = os.environ.get(_AUTOLOAD)


def user_environment() -> dict:
    """The environment for probe children: this process's, with torch's autoload switch as it started."""
    env = dict(os.environ)
    env.pop(_AUTOLOAD, None)
    if _START_AUTOLOAD is not None:
        env[_AUTOLOAD] = _START_AUTOLOAD
    return env


def interpreter_command() -> list:
    """This interpreter with the flags it runs under (-I, -E, -s, ...), so a probe child sees the same
    sys.path: under ``python -I`` a plain child read PYTHONPATH and the user site, and found
    frameworks the parent did not."""
    return [sys.executable, *subprocess._args_from_interpreter_flags()]


def _child(code: str, timeout: float = 300, args: tuple = ()) -> tuple:
    """Run a probe in a fresh interpreter with the user's environment; return (result dict, error)."""
    try:
        proc = subprocess.run([*interpreter_command(), "-c", code, *args], capture_output=True, text=True,
                              timeout=timeout, env=user_environment())
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout}s"
    for line in proc.stdout.splitlines():
        if line.startswith(_MARK):
            return json.loads(line[len(_MARK):]), None
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    how = (f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit code {proc.returncode}")
    return None, (f"{lines[-1]} ({how})" if lines else how)


def _first_and_root(causes: list) -> str:
    """``Outer: msg (caused by Root: msg)``: torch wraps a backend's ImportError in a RuntimeError."""
    return causes[0] if len(causes) == 1 else f"{causes[0]} (caused by {causes[-1]})"


def _installed(spec: FrameworkSpec, frameworks: Mapping):
    return frameworks.get(spec.name) or detect_framework(spec, distribution_index())


def environment(frameworks: Mapping) -> dict:
    """Python, torch and torch_npu facts; every import happens in a child with the user's environment.
    ``frameworks``: those detected already (RuntimeSnapshot.frameworks); torch and torch_npu are
    detected here when the matrix does not name them."""
    torch_npu, torch = _installed(_TORCH_NPU, frameworks), _installed(_TORCH, frameworks)
    env = {"python": platform.python_version(), "platform": f"{sys.platform} {platform.machine()}",
           "torch": torch.version if torch.installed else None, "device": None, "device_error": None,
           "torch_npu": {"installed": torch_npu.installed, "version": torch_npu.version,
                         "importable": None, "import_error": None}}
    result, error = _child(_DEVICE_PROBE)
    if result is not None and "error" not in result:
        env.update(result)
    else:
        env["device_error"] = error or _first_and_root(result["error"])
    if torch_npu.installed:
        result, error = _child(_TORCH_NPU_PROBE)
        import_error = error or (result["error"][-1] if "error" in result else None)
        env["torch_npu"].update(importable=import_error is None, import_error=import_error)
    return env


def environment_errors(env: dict) -> list:
    """Findings about the platform that make doctor exit 1, each with its next step."""
    npu = env["torch_npu"]
    if npu["installed"] and npu["importable"] is False:
        return [f"torch_npu {npu['version']} is installed but cannot be imported: {npu['import_error']}. "
                "With torch_npu installed, `import torch` loads it too and fails the same way. Next step: "
                "load the CANN environment (source the set_env.sh of your CANN toolkit, e.g. "
                "/usr/local/Ascend/ascend-toolkit/set_env.sh) and run doctor again"]
    return []


def environment_warnings(env: dict) -> list:
    warnings = []
    if os.environ.get(_AUTOLOAD, "1") != "1":
        warnings.append(f"{_AUTOLOAD}={os.environ[_AUTOLOAD]} turns off torch's backend autoload, ours "
                        "included: patches apply only where the script runs `import npu_fsdp_patches`")
    if not env["torch"]:
        warnings.append(f"torch is not installed in this Python ({sys.executable}): no patch can apply "
                        "here. Install npu-fsdp-patches into your training environment and run doctor there")
    elif env["device_error"] and not environment_errors(env):
        warnings.append(f"torch {env['torch']} is installed but `import torch` fails: {env['device_error']}")
    return warnings


def _gated_on(snap: RuntimeSnapshot) -> set:
    """The frameworks some enabled patch's gate names: the ones whose import decides whether it applies."""
    names = set()
    for record in snap.records:
        spec = snap.matrix.patches.get(record["name"]) if snap.matrix is not None else None
        if record["decision"] == "enabled" and spec is not None:
            names |= {cond.framework for alternative in spec.gate for cond in alternative}
    return names


def import_frameworks(snap: RuntimeSnapshot, every: bool = False) -> dict:
    """framework -> None (imports) or why it cannot be imported, for every framework an enabled patch
    gates on (``every``: every installed framework, as ``--import`` asks) and every meta package found
    without its part; imported in one child interpreter, so a framework that crashes the interpreter is
    reported, never fatal. torch and torch_npu have their own probes. Otherwise a framework no enabled
    patch needs is not imported (its row stays metadata only)."""
    if snap.matrix is None:
        return {}
    wanted, modules = _gated_on(snap), {}
    for name, found in snap.frameworks.items():
        spec = snap.matrix.frameworks.get(name)
        if spec is None or not spec.module or name in (_TORCH.name, _TORCH_NPU.name):
            continue
        if found.source == "meta package only" or (found.installed and (every or name in wanted)):
            modules[name] = spec.module
    if not modules:
        return {}
    result, error = _child(_FRAMEWORKS_PROBE, args=(json.dumps(modules),))
    if result is None:
        return {name: f"importing it crashed the interpreter: {error}" for name in modules}
    return {name: _first_and_root(causes) if causes else None for name, causes in result.items()}


def dependency_versions(matrix, name: str) -> dict:
    """distribution -> installed version (None: not installed) of what framework ``name`` depends on."""
    spec = matrix.frameworks.get(name) if matrix is not None else None
    if spec is None or not spec.depends_on:
        return {}
    index = distribution_index()
    return {dist: (index[normalize(dist)].version if normalize(dist) in index else None)
            for dist in spec.depends_on}


def framework_errors(frameworks: dict, matrix, records: list = ()) -> list:
    """An error for each framework that is installed but cannot be imported, with the next step and the
    versions of what it depends on (the matrix's ``depends_on``: what usually broke it). The enabled
    patches whose gate names it are named: one whose targets are elsewhere (in torch) may still apply,
    yet cannot take effect in a job that cannot import the framework."""
    out = []
    enabled = [r["name"] for r in records if r["decision"] == "enabled" and r["name"] in matrix.patches]
    for name, fw in frameworks.items():
        if fw.get("importable") is not False or name in (_TORCH.name, _TORCH_NPU.name):
            continue   # torch's and torch_npu's own findings say it (environment_errors, _warnings)
        what = f"{fw['distribution'] or name} {fw['version'] or '(unknown version)'}"
        reason = fw["import_error"] or "unknown"
        if fw["source"] == "meta package only" and fw.get("note"):
            reason = fw["note"] + (f"; importing it raises {fw['import_error']}" if fw["import_error"] else "")
        reason = reason.rstrip(". ")
        module = matrix.frameworks[name].module
        gated = [patch for patch in enabled
                 if any(cond.framework == name for alt in matrix.patches[patch].gate for cond in alt)]
        effect = (f"{', '.join(gated)} {'is' if len(gated) == 1 else 'are'} enabled for it but cannot take "
                  "effect" if gated else "No patch that needs it can apply")
        deps = [f"{dist} {version or 'not installed'}" for dist, version in (fw.get("depends_on") or {}).items()]
        here = f" (what it depends on, here: {', '.join(deps)})" if deps else ""
        out.append(f"{name}: {what} is installed but not importable: {reason}. {effect}; a job that imports "
                   f"it fails the same way. Next step: make `import {module}` work in this Python{here} "
                   "(install what the error names) and run doctor again")
    return out


def import_targets_in_child() -> tuple:
    """(status records, errors) after importing every enabled target in a fresh interpreter.

    Importing in this process could leave a half-imported torch behind (a failing backend autoload)
    and crash it at exit; a child that crashes is reported instead.
    """
    result, error = _child(_TARGETS_PROBE)
    if result is None:
        return None, [f"importing the patch targets crashed the interpreter: {error}"]
    if "torch_error" in result:
        return None, [f"patch targets not imported: `import torch` fails: {_first_and_root(result['torch_error'])}"]
    return result["patches"], result["errors"]


def _import_error(module: str, exc: BaseException, optional: bool) -> str | None:
    """How importing target ``module`` failed: "not found" only when the module itself (or a package
    above it) is missing; any other error, a missing dependency included, as raised and where."""
    if isinstance(exc, ModuleNotFoundError) and exc.name and (module + ".").startswith(exc.name + "."):
        return None if optional else f"import {module}: not found"
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<")]
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"import {module}: {type(exc).__name__}: {exc}{where}"


def import_targets() -> list:
    """Import every enabled patch's target modules so their hooks fire here; return import errors.

    A patch still pending after one of its target modules raised (it is there, but its import fails:
    a framework that cannot be imported) cannot apply in this environment: it is failed with that
    error. A target module that is not there leaves the patch pending (``not found``, a warning)."""
    errors, failed, absent = [], {}, {}
    snap = RUNTIME.snapshot()
    for record in snap.records:
        if record["decision"] != "enabled":
            continue
        spec = snap.matrix.patches[record["name"]]
        for module in spec.target_modules:
            # an optional module belongs to another framework generation: its absence is no error
            optional = all(t.optional for t in spec.targets if t.module == module)
            try:
                importlib.import_module(module)
            except Exception as exc:  # noqa: BLE001 - reported, never fatal
                error = _import_error(module, exc, optional)
                if error is None or error.endswith(": not found"):
                    absent.setdefault(record["name"], []).append(module)
                if error:
                    errors.append(error)
                    if not error.endswith(": not found"):   # it is there, and raises
                        failed.setdefault(record["name"], error)
    for name, error in failed.items():
        RUNTIME.target_import_failed(name, f"target not importable: {error}")
    return _explain_pending(errors, absent, snap.matrix)


def _explain_pending(errors: list, absent: dict, matrix) -> list:
    """A patch that no target module of exists for stays pending for good in this environment: one
    warning says so, in place of its bare "import X: not found" lines (an installed framework without the
    patched part, e.g. a build without the class the patch targets)."""
    pending = {r["name"] for r in RUNTIME.status() if r["state"] == "pending"}
    for name, modules in absent.items():
        if name not in pending or set(modules) != set(matrix.patches[name].target_modules):
            continue
        errors = [e for e in errors if e not in {f"import {m}: not found" for m in modules}]
        errors.append(f"{name} stays pending: none of its target modules is in this Python ({', '.join(modules)} "
                      "not found), so nothing here can apply it; it applies in a job that imports one of them")
    return errors


def forced_pending(records: list) -> list:
    """Errors for patches forced on (NPU_FSDP_PATCHES_ENABLE) that importing their targets left pending."""
    return [f"{r['name']}: forced on by {PREFIX}_ENABLE but still pending after importing its targets "
            f"(waiting for {', '.join(r['waiting_for']) or 'its target modules'}): it would not apply in "
            "training either" for r in records if r["explicit"] and r["state"] == "pending"]


def warnings_for(records: list) -> list:
    out = []
    for r in records:
        if r["decision"] == "enabled" and r["unverified"]:
            out.append(f"{r['name']}: {', '.join(r['unverified'])} in range but not verified by the test suite")
        # a target imported before activation is harmless once every copy is patched (hyper-parallel
        # imports torch.optim first for every user): only a module still holding an original is worth a word
        modules = r["imported_before_activation"]
        holders = sorted({m for refs in r["stale_refs"].values() for m in refs})
        if modules and holders:
            out.append(f"{r['name']}: {', '.join(modules)} {'was' if len(modules) == 1 else 'were'} imported "
                       f"before npu_fsdp_patches activated; stale references to the unpatched objects in: "
                       f"{', '.join(holders)}")
    return out


def code_findings(snap: RuntimeSnapshot) -> tuple:
    """(errors, warnings): every patch whose code disagrees with its matrix entry (verify.problems).
    An enabled patch failed on it at activation (an error); a disabled one would (a warning)."""
    errors, warnings = [], []
    for record in snap.records:
        name = record["name"]
        if RUNTIME.provider(name) is None:
            continue   # a provider conflict, already reported
        try:
            found = RUNTIME.code_problems(name)
        except Exception as exc:  # noqa: BLE001 - reported, never fatal
            found = [f"cannot load it: {type(exc).__name__}: {exc}"]
        if found:
            text = f"{name}: patch code does not match the matrix: " + "; ".join(found)
            (errors if record["decision"] == "enabled" else warnings).append(text)
    return errors, warnings


def plugin_section(snap: RuntimeSnapshot | None = None) -> dict:
    """The plugin's own state, shared by every JSON document the CLI prints."""
    snap = snap or RUNTIME.snapshot()
    settings = snap.settings
    return {"version": __version__, "active": snap.active, "matrix": snap.matrix_path,
            "config_error": snap.config_error,
            "strict": settings.strict or (snap.config_error is not None and strict_requested(os.environ)),
            "disable": sorted(settings.disable) + (["*"] if settings.disable_all else []),
            "enable": sorted(settings.enable)}


def collect(*, try_import: bool = False, self_test: bool = False) -> dict:
    """The full doctor report; ``exit_code`` is 0 healthy, 1 a patch or the platform failed, 2 bad configuration."""
    RUNTIME.ensure_prepared()
    snap = RUNTIME.snapshot()
    env = environment(snap.frameworks)
    records, import_errors, import_failed = None, [], []
    if try_import and snap.matrix is not None:
        records, import_errors = import_targets_in_child()
        if records is None:   # nothing could be verified: an error, not a warning
            import_failed, import_errors = import_errors, []
        else:
            import_failed = forced_pending(records)
    records = records if records is not None else RUNTIME.status()
    failed_with = [r["error"] for r in records if r["state"] == "failed" and r["error"]]
    import_errors = [e for e in import_errors if not any(e in why for why in failed_with)]
    code_errors, code_warnings = code_findings(snap)
    env["detection"] = detection_environment(snap.matrix, [n for n, d in snap.frameworks.items() if d.installed])
    frameworks = {n: {**d.as_dict(), "importable": None, "import_error": None,
                      "depends_on": dependency_versions(snap.matrix, n)}
                  for n, d in snap.frameworks.items()}
    # where `import torch` fails, every framework fails with it: the torch finding says it once
    for name, why in (import_frameworks(snap, every=try_import) if env["device_error"] is None else {}).items():
        frameworks[name].update(importable=why is None, import_error=why)
    _platform_rows(frameworks, env)
    broken = {name for name, fw in frameworks.items() if fw["importable"] is False}
    report = {
        "schema": SCHEMA, "schema_version": SCHEMA_VERSION,
        "plugin": plugin_section(snap),
        "environment": env,
        "frameworks": frameworks,
        "patches": records,
        "errors": (environment_errors(env) + framework_errors(frameworks, snap.matrix, records) + import_failed
                   + code_errors),
        "warnings": _warnings(snap, records, env, broken) + import_errors + code_warnings,
        "self_test": None,
    }
    report["warnings"] += list(snap.settings.warnings) + list(filter(None, [snap.unknown_names_message()]))
    report["late_detections"] = [dict(found) for found in snap.late_detections]
    report["warnings"] += [f"{found['framework']} was found after activation, when {found['module']} was "
                           f"first imported; decided then: {', '.join(found['enabled']) or 'no patch enabled'}"
                           for found in snap.late_detections]
    report["warnings"] = list(dict.fromkeys(report["warnings"]))
    if self_test:
        report["self_test"] = (_self_test() if env["device_error"] is None else
                               {"passed": False, "error": f"torch cannot be imported: {env['device_error']}"})
    failed = any(r["state"] == "failed" for r in records) or bool(report["errors"]) or (
        report["self_test"] is not None and not report["self_test"].get("passed"))
    report["exit_code"] = (EXIT_BAD_CONFIG if snap.config_error else
                           EXIT_PATCH_FAILED if failed else EXIT_OK)
    return report


def _platform_rows(frameworks: dict, env: dict) -> None:
    """torch's and torch_npu's rows say what their own probes found, so the sections agree."""
    probed = {_TORCH.name: (env["device_error"] is None, env["device_error"]),
              _TORCH_NPU.name: (env["torch_npu"]["importable"], env["torch_npu"]["import_error"])}
    for name, (importable, error) in probed.items():
        row = frameworks.get(name)
        if row is not None and row["installed"] and importable is not None:
            row.update(importable=importable, import_error=error)


def _warnings(snap: RuntimeSnapshot, records: list, env: dict, broken: set) -> list:
    """The torch gate, the patches', the providers', the frameworks' and the platform's warnings."""
    return (torch_findings(snap.frameworks.get("torch"), snap.matrix) + warnings_for(records)
            + list(snap.provider_conflicts.values())
            + [f"{name}: {fw.note}" for name, fw in snap.frameworks.items()
               if fw.note and name not in broken]   # the error of a broken one says it (framework_errors)
            + environment_warnings(env))


def _self_test() -> dict:
    try:
        from ..selftest.checks.adamw_step import run_self_test
        return run_self_test()
    except Exception as exc:  # noqa: BLE001 - a broken self-test is a failed self-test
        return {"passed": False, "error": f"{type(exc).__name__}: {exc}"}
