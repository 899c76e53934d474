"""Merge per-rank check results, and render the self-test report as text or JSON.

JSON schema ``npu-fsdp-patches/self-test`` version 1 (docs/self_test.md)::

    {"schema": "npu-fsdp-patches/self-test", "schema_version": 1, "mode": "launched" | "in_job",
     "device": "npu", "backend": "hccl", "world_size": 8, "nproc_per_node": 8,
     "versions": {"python": str, "torch": str, "torch_npu": str | null, "npu_fsdp_patches": str,
                  "frameworks": {NAME: VERSION}},
     "checks": [CHECK, ...], "ranks": [RANK, ...] | null, "timed_out": bool,
     "patches_applied": [str, ...] | null,  # applied in the ranks while the checks ran (null: no check finished)
     "nothing_patched": bool,           # true: no patch was applied; the checks verified optim's numerics only
     "stopped_by": "SIGTERM" | "SIGHUP" | "SIGINT" | null,
     "passed": bool, "exit_code": 0 | 1 | 124 (timed out) | 128 + signal (stopped by it)}
    CHECK = {"name": str, "status": "passed" | "failed" | "skipped" | "not run",
             "patches": [str, ...],     # the patch this check verifies, when it was applied
             "reason": str | null, "seconds": float | null, "elements": int | null,
             "mismatches": int | null, "max_abs_error": float | null, "tolerance": str | dict | null,
             "first_mismatch": null | {"rank": int, "what": str, "index": [int, ...],
                                       "expected": float, "got": float},
             "error": null | {"rank": int, "message": str, "traceback": str},
             "details": {...}}          # check-specific figures reported by rank 0 (steps, ...)
    RANK = {"rank": int, "state": "finished" | "hung" | "died" | "stopped" | "failed" | "not started",
            "check": str | null, "last_finished": str | null, "seconds_in_check": float | null,
            "error": str | null}
"""
from __future__ import annotations

import signal
from typing import Optional

SCHEMA = "npu-fsdp-patches/self-test"
SCHEMA_VERSION = 1
_FIGURES = ("passed", "elements", "mismatches", "max_abs_error", "first_mismatch", "tolerance", "seconds",
            "error", "traceback", "skipped", "patches", "applied")
EXIT_TIMEOUT = 124


def merge(name: str, per_rank: list) -> dict:
    """One check's result over all ranks: passes only when every rank passed."""
    results = [r for r in per_rank if r is not None]
    check = _empty(name, "not run")
    if not results:
        return check
    check["applied"] = sorted({name for r in results for name in r.get("applied", ())})
    check["patches"] = sorted({name for r in results for name in r.get("patches", ())})
    skipped = next((r["skipped"] for r in results if "skipped" in r), None)
    if skipped is not None:
        check.update(status="skipped", reason=skipped, seconds=max(r.get("seconds", 0) for r in results))
        return check
    missing = [rank for rank, r in enumerate(per_rank) if r is None]
    passed = not missing and all(r.get("passed") for r in results)
    errors = [max(0.0, r["max_abs_error"]) for r in results if r.get("max_abs_error") is not None]
    first = next(({"rank": i, **r["first_mismatch"]} for i, r in enumerate(per_rank)
                  if r and r.get("first_mismatch")), None)
    error = next(({"rank": i, "message": r["error"], "traceback": r.get("traceback", "")}
                  for i, r in enumerate(per_rank) if r and r.get("error")), None)
    check.update(status="passed" if passed else "failed",
                 reason=f"no result from rank(s) {', '.join(map(str, missing))}" if missing else None,
                 seconds=max(r.get("seconds", 0.0) for r in results),
                 elements=sum(r.get("elements") or 0 for r in results),
                 mismatches=sum(r.get("mismatches") or 0 for r in results),
                 max_abs_error=max(errors) if errors else None, tolerance=results[0].get("tolerance"),
                 first_mismatch=first, error=error,
                 details={k: v for k, v in results[0].items() if k not in _FIGURES})
    if check["status"] == "failed" and not check["reason"]:
        check["reason"] = failure_reason(check)   # every failure says why, in every rendering
    return check


def failure_reason(check: dict) -> str:
    """Why a failed check failed, in one line: the error a rank raised, else the first mismatch."""
    error, first = check.get("error"), check.get("first_mismatch")
    if error:
        return f"error on rank {error['rank']}: {error['message']}"
    if first:
        return (f"{check.get('mismatches')} mismatches (max abs error {_number(check.get('max_abs_error'))}, "
                f"tolerance {_tolerance(check.get('tolerance'))}); first: rank {first['rank']} "
                f"{first['what']} index {first['index']}: expected {first['expected']!r} got {first['got']!r}")
    return (f"{check.get('mismatches')} mismatches, max abs error {_number(check.get('max_abs_error'))} "
            f"(tolerance {_tolerance(check.get('tolerance'))})")


def _empty(name: str, status: str, reason: Optional[str] = None) -> dict:
    return {"name": name, "status": status, "patches": [], "reason": reason, "seconds": None, "elements": None,
            "mismatches": None, "max_abs_error": None, "tolerance": None, "first_mismatch": None,
            "error": None, "details": {}}


def skipped(name: str, reason: str) -> dict:
    return _empty(name, "skipped", reason)


def not_run(name: str, reason: str) -> dict:
    return _empty(name, "not run", reason)


def checks_passed(checks: list) -> bool:
    """At least one check ran and every one that ran passed (a skipped check does not count either way)."""
    ran = [c for c in checks if c["status"] != "skipped"]
    return bool(ran) and all(c["status"] == "passed" for c in ran)


def assemble(plan, versions: dict, checks: list, ranks: Optional[list], timed_out: bool, world: int,
             stopped_by: Optional[int] = None) -> dict:
    """The report; ``stopped_by`` is the signal number that ended the run early."""
    known = [c.pop("applied") for c in checks if "applied" in c]   # from the checks a rank finished
    applied = sorted({name for names in known for name in names}) if known else None
    ranks_ok = ranks is None or all(r["state"] == "finished" for r in ranks)
    passed = checks_passed(checks) and ranks_ok and not timed_out and stopped_by is None
    code = 128 + stopped_by if stopped_by else EXIT_TIMEOUT if timed_out else 0 if passed else 1
    return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "mode": "in_job" if plan.in_job else "launched",
            "device": plan.device, "backend": plan.backend, "world_size": world,
            "nproc_per_node": None if plan.in_job else plan.nproc_per_node, "versions": versions,
            "checks": checks, "ranks": ranks, "timed_out": timed_out, "patches_applied": applied,
            "nothing_patched": applied == [],
            "stopped_by": signal.Signals(stopped_by).name if stopped_by else None,
            "passed": passed, "exit_code": code}


def _number(value) -> str:
    return "-" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value)


#: the check-name column: as wide as the longest built-in check name (te_fused_adam, hyper_skip_dispatch)
NAME_WIDTH = 20


def check_line(check: dict) -> str:
    """The progress line of one check, plus its first mismatch / error when it failed. The columns
    (name, seconds, figures) line up from check to check; the patch a check verified comes last."""
    tag = {"passed": "PASS", "failed": "FAIL", "skipped": "SKIP"}.get(check["status"], "----")
    line = f"[{tag}] {check['name']:<{NAME_WIDTH}} "
    if check["status"] in ("skipped", "not run"):
        return f"{line}{'-':>7}    {check['reason'] or check['status']}"
    line += (f"{_seconds(check['seconds']):>7} s  elements {_number(check['elements'])}  mismatches "
             f"{_number(check['mismatches'])}  max abs error {_number(check['max_abs_error'])}  "
             f"tolerance {_tolerance(check['tolerance'])}")
    if check.get("patches"):
        line += f"  (patch {', '.join(check['patches'])})"
    if check["reason"] and check["reason"] != failure_reason(check):
        line += f"\n       {check['reason']}"
    first = check["first_mismatch"]
    if first:
        line += (f"\n       first mismatch: rank {first['rank']} {first['what']} index {first['index']}: "
                 f"expected {first['expected']!r} got {first['got']!r}")
    if check["error"]:
        line += f"\n       error on rank {check['error']['rank']}: {check['error']['message']}"
    return line


def _seconds(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def _tolerance(tolerance) -> str:
    if tolerance is None:   # a check that raised before it compared anything
        return "-"
    if isinstance(tolerance, dict):
        return "; ".join(f"{k} {v if isinstance(v, str) else ', '.join(f'{a}={b}' for a, b in v.items())}"
                         for k, v in tolerance.items())
    return str(tolerance)


def header(report_like: dict) -> str:
    v = report_like["versions"]
    frameworks = ", ".join(f"{k} {ver}" for k, ver in v["frameworks"].items()) or "none detected"
    return (f"npu-fsdp-patches self-test: {report_like['world_size']} rank(s) on {report_like['device']} "
            f"({report_like['backend']}), torch {v['torch']}, torch_npu {v['torch_npu'] or '-'}, "
            f"frameworks: {frameworks}")


def summary(report: dict) -> str:
    counts = {}
    for c in report["checks"]:
        counts[c["status"]] = counts.get(c["status"], 0) + 1
    lines = []
    for r in report["ranks"] or []:
        if r["state"] != "finished":
            where = f" in check {r['check']}" if r["check"] else \
                f" after check {r['last_finished']} (waiting for the other ranks)" if r["last_finished"] else ""
            spent = f" ({r['seconds_in_check']:.1f} s in it)" if r["seconds_in_check"] is not None else ""
            lines.append(f"rank {r['rank']}: {r['state']}{where}{spent}" + (f": {r['error']}" if r["error"] else ""))
    if report["timed_out"]:
        lines.append("timed out: every rank still running was killed")
    if report["nothing_patched"]:
        lines.append("nothing patched: no npu_fsdp_patches patch was applied in the ranks; the checks "
                     "verified the standalone optim numerics only")
    elif report["patches_applied"]:
        lines.append(f"patches applied: {', '.join(report['patches_applied'])}")
    verdict = "PASSED" if report["passed"] else "FAILED"
    lines.append(f"{verdict}: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
                 + f" (exit {report['exit_code']})")
    return "\n".join(lines)
