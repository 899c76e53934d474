"""``npu-fsdp-patches`` / ``python -m npu_fsdp_patches``: doctor, explain NAME, list, self-test, report,
checkpoint PATH.

Exit codes and JSON schemas: docs/cli.md. No command ends in a traceback (output_guard).
"""
from __future__ import annotations

import argparse
import json
import sys

from .. import __version__, selftest
from ..plan import loader
from ..plan.settings import ENV_VARS
from ..runtime.facade import RUNTIME
from ..selftest import runner as selftest_runner
from ..selftest.quick_exit import exit_without_teardown
from . import checkpoint, report
from .doctor import EXIT_BAD_CONFIG, EXIT_PATCH_FAILED, collect, plugin_section
from .output_guard import guarded
from .render import doctor_text, explain_text, gate_data, list_text, unknown_patch_message


def _parser() -> argparse.ArgumentParser:
    epilog = "environment variables (read when npu_fsdp_patches is imported):\n" + "\n".join(
        f"  {name:<26} {meaning}" for name, meaning in ENV_VARS.items())
    parser = argparse.ArgumentParser(prog="npu-fsdp-patches", epilog=epilog,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     description="Report, explain, list and self-test the npu_fsdp_patches patches; "
                                                 "with no command, doctor.")
    parser.add_argument("--version", action="version", version=f"npu-fsdp-patches {__version__}")
    sub = parser.add_subparsers(dest="command")
    doctor = sub.add_parser("doctor", help="report environment, frameworks, patch decisions and states")
    doctor.add_argument("--json", action="store_true", help="one JSON object (schema npu-fsdp-patches/doctor)")
    doctor.add_argument("--import", dest="try_import", action="store_true",
                        help="also try importing torch_npu and the enabled patches' target modules")
    doctor.add_argument("--self-test", action="store_true",
                        help="check the bit-exact AdamW step against torch on this machine's device")
    explain = sub.add_parser("explain", help="why a patch would or would not apply, and what it changes")
    explain.add_argument("name")
    explain.add_argument("--json", action="store_true", help="one JSON object (schema npu-fsdp-patches/explain)")
    listing = sub.add_parser("list", help="list every patch in the matrix")
    listing.add_argument("--json", action="store_true", help="one JSON object (schema npu-fsdp-patches/list)")
    selftest.add_arguments(sub.add_parser(
        "self-test", help="run every enabled patch's checks on this machine's devices, backend and ranks"))
    report.add_arguments(sub.add_parser(
        "report", help="write a bug report (OUTPUT.json and OUTPUT.md): doctor, self-test, OS, Ascend stack"))
    checkpoint.add_arguments(sub.add_parser(
        "checkpoint", help="a checkpoint's layout, its fp32 main params and what each loader will do with it; "
                           "--convert-to upstream|torch OUT"))
    return parser


def _patch_doc(name: str) -> str | None:
    """What the patch changes: its class docstring, read as data from the patch module's source (so that
    ``python -OO``, which strips docstrings, keeps it), else the loaded class's or module's docstring."""
    provider = RUNTIME.provider(name) or loader.available().get(name)
    value = provider.value if provider else None
    if not value:
        return None
    from ..plan import declarations   # ast: not on the activation path
    module = value.partition(":")[0]
    for declared in declarations.read_module(module):
        if declared.value == value and declared.doc:
            return declared.doc
    try:
        patch_class = type(loader.load_patch(value))
    except Exception:  # noqa: BLE001 - explain still works without the docstring
        return None
    return patch_class.__doc__ or getattr(sys.modules.get(patch_class.__module__), "__doc__", None)


def _emit(as_json: bool, command: str, exit_code: int, text: str | None, error: str | None = None,
          **fields) -> int:
    """Print text (errors to stderr), or one complete JSON document that always carries the error."""
    if as_json:
        print(json.dumps({"schema": f"npu-fsdp-patches/{command}", "schema_version": 1,
                          "plugin": plugin_section(), **fields, "error": error, "exit_code": exit_code}, indent=2))
    elif error:
        print(f"npu-fsdp-patches: {error}", file=sys.stderr)
    else:
        print(text)
    return exit_code


def _doctor(args: argparse.Namespace, as_json: bool) -> int:
    try:
        result = collect(try_import=getattr(args, "try_import", False),
                         self_test=getattr(args, "self_test", False))
    except Exception as exc:  # noqa: BLE001 - doctor reports, it never dies with a traceback
        return _emit(as_json, "doctor", EXIT_PATCH_FAILED, None, f"doctor failed: {type(exc).__name__}: {exc}")
    print(json.dumps(result, indent=2) if as_json else doctor_text(result))
    return result["exit_code"]


def _run(argv: list | None) -> int:
    args = _parser().parse_args(argv)
    command = args.command or "doctor"
    if command == "self-test":
        return selftest.main(args)
    if command == "report":
        return report.main(args)
    if command == "checkpoint":
        return checkpoint.main(args)
    as_json = getattr(args, "json", False)
    if command == "doctor":
        return _doctor(args, as_json)
    RUNTIME.ensure_prepared()
    snap = RUNTIME.snapshot()
    if snap.matrix is None:
        return _emit(as_json, command, EXIT_BAD_CONFIG, None, f"inactive: {snap.config_error}", patches=[])
    records = {r["name"]: r for r in RUNTIME.status()}
    if command == "list":
        return _emit(as_json, command, 0, list_text(records.values()), patches=list(records.values()))
    spec = snap.matrix.patches.get(args.name)
    if spec is None:
        return _emit(as_json, command, EXIT_BAD_CONFIG, None,
                     unknown_patch_message(args.name, records), patch=None)
    text = explain_text(spec, records.get(args.name), snap.frameworks, _patch_doc(args.name))
    return _emit(as_json, command, 0, text, patch=records.get(args.name),
                 gate=gate_data(spec, snap.frameworks), explanation=text.splitlines())


def main(argv: list | None = None) -> int:
    """Run one command; an output it cannot write ends it with one line, never a traceback.

    Run as the process's command (no ``argv``), a self-test rank inside a torchrun job ends here without
    interpreter teardown once all is reported: gloo's background threads can abort a rank at exit
    ("terminate called without an active exception", SIGABRT) and fail the user's passing job.
    """
    code = guarded(lambda: _run(argv))
    if argv is None and selftest_runner.RAN_IN_JOB:
        exit_without_teardown(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
