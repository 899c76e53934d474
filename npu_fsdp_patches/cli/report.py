"""``npu-fsdp-patches report``: one bug report, written as OUTPUT.json and its Markdown rendering
OUTPUT.md (to paste into an issue). Schema "npu-fsdp-patches/report": docs/cli.md#report-json-schema.

It bundles doctor's JSON (with ``--import``), the ``self-test --json`` result (run as a child with a
time limit, or the reason it was skipped) and report_env's facts about the machine. Exit code 0 when
both files are written, whatever they report; 2 when they cannot be written or an option is unusable.
"""
from __future__ import annotations

import argparse
import errno
import json
import math
import os
import stat
import subprocess
import sys
from pathlib import Path

from ..selftest.options import MAX_TIMEOUT_S
from . import report_env
from .doctor import collect, interpreter_command, user_environment
from .render import doctor_text

SCHEMA, SCHEMA_VERSION = "npu-fsdp-patches/report", 2
DEFAULT_OUTPUT = "npu-fsdp-patches-report"
DEFAULT_SELF_TEST_TIMEOUT_S = 900.0
EXIT_WRITTEN, EXIT_CANNOT_WRITE = 0, 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", default=DEFAULT_OUTPUT, metavar="PATH",
                        help=f"write PATH.json and PATH.md; a folder (existing, or PATH ending in /) gets "
                             f"{DEFAULT_OUTPUT}.json and .md inside (default: {DEFAULT_OUTPUT} here)")
    parser.add_argument("--no-self-test", action="store_true", help="do not run the self-test")
    parser.add_argument("--self-test-timeout", type=float, default=DEFAULT_SELF_TEST_TIMEOUT_S, metavar="S",
                        help=f"seconds the self-test may take (default {DEFAULT_SELF_TEST_TIMEOUT_S:g})")


def run_self_test(timeout: float) -> dict:
    """``self-test --json`` in a child interpreter: its result, or {"skipped": why} / {"error": ...}."""
    command = [*interpreter_command(), "-m", "npu_fsdp_patches", "self-test", "--json", "--timeout", f"{timeout:g}"]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout + 60,
                              env=user_environment())
    except subprocess.TimeoutExpired:
        return {"error": f"the self-test did not finish within {timeout + 60:g}s and was stopped"}
    except OSError as exc:
        return {"error": f"cannot start the self-test: {exc}"}
    try:
        return {"exit_code": proc.returncode, "result": json.loads(proc.stdout)}
    except ValueError:
        return {"exit_code": proc.returncode, "error": "the self-test printed no JSON result",
                "stderr_tail": proc.stderr[-3000:]}


def progress(line: str) -> None:
    """One line per stage on stderr, so a report that runs for a minute is not silent (stdout keeps
    only the final 'wrote ...' line)."""
    print(f"npu-fsdp-patches report: {line}", file=sys.stderr, flush=True)


def collect_report(self_test: bool, self_test_timeout: float, say=progress) -> dict:
    say("[1/4] doctor --import (imports every installed framework and the enabled patches' targets in children) ...")
    doctor = collect(try_import=True)
    say("[2/4] system and packages ...")
    system = report_env.system()
    packages = report_env.packages(doctor["frameworks"], _matrix())
    say(f"[3/4] Ascend facts: CANN toolkit, NPU driver, npu-smi (up to {report_env.NPU_SMI_TIMEOUT_S:g} s) ...")
    ascend = report_env.ascend()
    if self_test:
        say(f"[4/4] self-test on this node's devices (up to {self_test_timeout:g} s) ...")
    else:
        say("[4/4] self-test skipped: --no-self-test was given")
    return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "system": system,
            "packages": packages, "ascend": ascend, "doctor": doctor,
            "self_test": (run_self_test(self_test_timeout) if self_test
                          else {"skipped": "--no-self-test was given"})}


def _matrix():
    """The matrix doctor read (its frameworks' distributions and dependencies), or None."""
    from ..runtime.facade import RUNTIME
    return RUNTIME.snapshot().matrix


def _ascend_rows(ascend: dict) -> list:
    smi = ascend["npu_smi"]
    if smi["status"] == "ok":
        npus = ", ".join(f"{n} x {model}" for model, n in smi["models"].items())
        npus += f" (npu-smi {smi['version']})" if smi.get("version") else ""
    else:
        npus = f"npu-smi: {smi['status']}"
    return [("CANN toolkit", ascend["cann_toolkit"]["version"]), ("NPU driver", ascend["driver"]["version"]),
            ("NPUs", npus)]


def _package_row(name: str, row: dict) -> str:
    """One Packages row: where it was found (metadata, or the source tree doctor found), and its role:
    a framework (with whether it imports) or what needs it."""
    found = row["found"] if row["found"] in ("metadata", report_env.NOT_FOUND) else \
        f"{row['found']}: {row['location']}"
    if row["framework"]:
        role = f"framework {row['framework']}" + {True: ", imports", False: ", **does not import** (see Doctor)",
                                                  None: ""}[row["importable"]]
    else:
        role = f"needed by {', '.join(row['needed_by'])}" if row["needed_by"] else ""
    return f"| {name} | {row['version'] or '-'} | {found} | {role} |"


def _detection_md(detection: dict) -> list:
    """What decides detection: PYTHONPATH entries (a checkout's git id) and the frameworks' variables."""
    rows = [(f"PYTHONPATH[{i}]", e["path"] + (f" ({e['git']})" if e.get("git") else "")
             + ("" if e.get("exists") else " (not a folder)")) for i, e in enumerate(detection.get("pythonpath") or [])]
    rows += [(name, "unset" if value is None else value) for name, value in (detection.get("variables") or {}).items()]
    if not rows:
        return ["", "Detection environment: PYTHONPATH unset; no framework variable applies."]
    return ["", "### Detection environment", "", "| | |", "| --- | --- |"] + [f"| {k} | {v} |" for k, v in rows]


def _self_test_md(result: dict) -> list:
    if "skipped" in result:
        return [f"Skipped: {result['skipped']}."]
    if "result" not in result:
        code = f" (exit code {result['exit_code']})" if result.get("exit_code") is not None else ""
        return [f"Error{code}: {result['error']}."] + (["", "```text", result["stderr_tail"].strip(), "```"]
                                                       if result.get("stderr_tail") else [])
    data = result["result"]
    lines = [f"{'PASSED' if data.get('passed') else 'FAILED'} on {data.get('device')} "
             f"({data.get('backend')}, {data.get('world_size')} ranks); exit code {result['exit_code']}", "",
             "| check | status | reason |", "| --- | --- | --- |"]
    return lines + [f"| {c['name']} | {c['status']} | {_reason(c).replace('|', '/')} |"
                    for c in data.get("checks") or []]


def _reason(check: dict) -> str:
    """The check's reason; a failed one without it (a self-test of an older version) says why from its
    error or first mismatch, as the JSON holds them."""
    if check.get("reason") or check.get("status") != "failed":
        return check.get("reason") or ""
    from ..selftest.report import failure_reason
    return failure_reason(check)


def markdown(report: dict, json_name: str) -> str:
    """The report as Markdown for an issue; the JSON file holds everything."""
    system = report["system"]
    rows = [("time (UTC)", system["time"]), ("host", system["host"]), ("OS", system["os"]),
            ("kernel", f"{system['kernel']} ({system['machine']})"), ("Python", system["python"])]
    rows += _ascend_rows(report["ascend"])
    lines = ["## npu-fsdp-patches report", "", "| | |", "| --- | --- |"]
    lines += [f"| {key} | {value} |" for key, value in rows]
    lines += ["", "### Packages", "", "| package | version | found | role |", "| --- | --- | --- | --- |"]
    lines += [_package_row(name, row) for name, row in report["packages"].items()]
    lines += _detection_md(report["doctor"]["environment"].get("detection") or {})
    lines += ["", f"### Doctor (exit code {report['doctor']['exit_code']})", "", "```text",
              doctor_text(report["doctor"]), "```", "", "### Self-test", ""] + _self_test_md(report["self_test"])
    lines += ["", f"Full data: `{json_name}` (schema {SCHEMA} {SCHEMA_VERSION})."]
    return "\n".join(lines) + "\n"


def is_folder(output: str) -> bool:
    """``-o`` names a folder: one that exists, or a path ending in a separator, ``.`` or ``..``."""
    return os.path.basename(output) in ("", ".", "..") or os.path.isdir(output)


def output_paths(output: str) -> tuple:
    """(PATH.json, PATH.md); inside PATH, named DEFAULT_OUTPUT, when PATH is a folder."""
    base = Path(output)
    if is_folder(output):
        base = base / DEFAULT_OUTPUT
    elif base.suffix in (".json", ".md"):
        base = base.with_suffix("")
    return base.with_name(base.name + ".json"), base.with_name(base.name + ".md")


def _write(path: Path, text: str) -> bool:
    """Write a regular file (a FIFO or device there is refused, never waited on); False after saying why."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK, 0o666)
        with open(fd, "w", encoding="utf-8", errors="backslashreplace") as fh:   # a path's undecodable byte
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, "not a regular file")
            fh.truncate(0)
            fh.write(text)
    except OSError as exc:
        print(f"npu-fsdp-patches report: cannot write {path}: {exc}", file=sys.stderr)
        return False
    return True


def usage_error(args: argparse.Namespace) -> str | None:
    """What is wrong with the options, before anything runs or is written (None: nothing)."""
    if not args.output:   # ``-o "$UNSET"``: a mistake, not a name
        return "-o needs a path, got an empty string"
    timeout = args.self_test_timeout
    if not math.isfinite(timeout) or not 0 < timeout <= MAX_TIMEOUT_S:
        return (f"--self-test-timeout {timeout:g}: need a finite number of seconds, more than 0 and at "
                f"most {MAX_TIMEOUT_S:g}")
    return None


def main(args: argparse.Namespace) -> int:
    error = usage_error(args)
    if error:
        print(f"npu-fsdp-patches report: {error}", file=sys.stderr)
        return EXIT_CANNOT_WRITE
    json_path, md_path = output_paths(args.output)
    if not _write(json_path, "") or not _write(md_path, ""):   # find out now, not after the self-test
        return EXIT_CANNOT_WRITE
    report = collect_report(not args.no_self_test, args.self_test_timeout)
    if not _write(json_path, json.dumps(report, indent=2) + "\n") or \
            not _write(md_path, markdown(report, json_path.name)):
        return EXIT_CANNOT_WRITE
    print(f"wrote {json_path} and {md_path}")
    return EXIT_WRITTEN
