"""``npu-fsdp-patches`` / ``python -m npu_fsdp_patches``: doctor, explain NAME, list, self-test."""
from __future__ import annotations

import argparse
import json
import sys

from . import loader, selftest
from .doctor import EXIT_BAD_CONFIG, collect
from .render import doctor_text, explain_text, list_text
from .runtime import RUNTIME


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="npu-fsdp-patches", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    doctor = sub.add_parser("doctor", help="report environment, frameworks, patch decisions and states")
    doctor.add_argument("--json", action="store_true", help="one JSON object (schema npu-fsdp-patches/doctor)")
    doctor.add_argument("--import", dest="try_import", action="store_true",
                        help="also try importing torch_npu and the enabled patches' target modules")
    doctor.add_argument("--self-test", action="store_true",
                        help="check the bit-exact AdamW step against torch on this machine's device")
    explain = sub.add_parser("explain", help="why a patch would or would not apply, and what it changes")
    explain.add_argument("name")
    sub.add_parser("list", help="list every patch in the matrix")
    selftest.add_arguments(sub.add_parser(
        "self-test", help="run every enabled patch's checks on this machine's devices, backend and ranks"))
    return parser


def _patch_doc(name: str) -> str | None:
    """The patch class's docstring, else its module's: what the patch changes."""
    value = RUNTIME._implementations.get(name) or loader.available().get(name)
    try:
        patch_class = type(loader.load_patch(value)) if value else None
    except Exception:  # noqa: BLE001 - explain still works without the docstring
        return None
    if patch_class is None:
        return None
    return patch_class.__doc__ or getattr(sys.modules.get(patch_class.__module__), "__doc__", None)


def main(argv: list | None = None) -> int:
    args = _parser().parse_args(argv)
    command = args.command or "doctor"
    if command == "self-test":
        return selftest.main(args)
    if command == "doctor":
        report = collect(try_import=getattr(args, "try_import", False),
                         self_test=getattr(args, "self_test", False))
        print(json.dumps(report, indent=2) if getattr(args, "json", False) else doctor_text(report))
        return report["exit_code"]
    RUNTIME.ensure_prepared()
    if RUNTIME.matrix is None:
        print(f"npu-fsdp-patches: inactive: {RUNTIME.config_error}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    records = {r["name"]: r for r in RUNTIME.status()}
    if command == "list":
        print(list_text(records.values()))
        return 0
    spec = RUNTIME.matrix.patches.get(args.name)
    if spec is None:
        print(f"npu-fsdp-patches: unknown patch {args.name!r}; known: {', '.join(sorted(records))}",
              file=sys.stderr)
        return EXIT_BAD_CONFIG
    print(explain_text(spec, records.get(args.name), RUNTIME.frameworks, _patch_doc(args.name)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
