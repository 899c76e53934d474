"""Run the self-test in one of its two modes and print the report.

``launched``: this process starts the ranks (:mod:`.launcher`) and renders what their status files
say. ``in_job``: this process is one rank of a torchrun job or srun step; rank 0 prints.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
from typing import Iterator, Optional

from . import report
from .checks import CHECKS
from .launcher import STOP_SIGNALS, Stopped
from .options import EXIT_BAD_OPTIONS, OptionError, Plan, job_env, resolve


def _records() -> dict:
    import npu_fsdp_patches  # pylint: disable=import-outside-toplevel

    return {r["name"]: r for r in npu_fsdp_patches.status()}


def _versions() -> dict:
    from importlib import metadata  # pylint: disable=import-outside-toplevel

    import npu_fsdp_patches  # pylint: disable=import-outside-toplevel

    def version(dist: str):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None
    import torch  # pylint: disable=import-outside-toplevel
    frameworks = {name: info.get("version") for name, info in npu_fsdp_patches.detect().items()
                  if info.get("version") and name not in ("torch", "torch_npu")}
    return {"python": sys.version.split()[0], "torch": torch.__version__, "torch_npu": version("torch_npu"),
            "npu_fsdp_patches": npu_fsdp_patches.__version__, "frameworks": frameworks}


def main(args: argparse.Namespace) -> int:
    """Run the self-test for parsed ``args``; returns the exit code (0 pass, 1 fail, 2 bad options or
    environment, 124 timed out, 128 + signal stopped by SIGTERM, SIGHUP or SIGINT)."""
    previous = _install_stop_handlers()
    try:
        plan = resolve(args, _records())
        versions = _versions()
        if plan.in_job:
            return _run_in_job(plan, versions, args.json)
        return _run_launched(plan, versions, args.json)
    except OptionError as exc:
        print(f"npu-fsdp-patches self-test: {exc}", file=sys.stderr)
        return EXIT_BAD_OPTIONS
    except Stopped as exc:   # before or after the ranks ran: nothing of the run is left
        print(f"npu-fsdp-patches self-test: stopped by {exc}", file=sys.stderr, flush=True)
        return 128 + exc.signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _install_stop_handlers() -> dict:
    """Turn SIGTERM/SIGHUP/SIGINT into :class:`Stopped` (once: further ones are ignored while the run
    cleans up); returns the handlers to restore. Only the main thread can install them."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def stop(signum, _frame):
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        raise Stopped(signum)
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    for sig in STOP_SIGNALS:
        signal.signal(sig, stop)
    return previous


def _emit(text: str, as_json: bool) -> None:
    """Progress goes to stdout in text mode and to stderr with --json (stdout stays one JSON object)."""
    print(text, file=sys.stderr if as_json else sys.stdout, flush=True)


@contextlib.contextmanager
def _stdout_kept_for_json(as_json: bool) -> Iterator[None]:
    """With --json inside a job, what native code in the ranks writes to file descriptor 1 (torch 2.9's gloo:
    "[Gloo] Rank 0 is connected to 1 peer ranks") goes to stderr while the checks run: stdout stays the one
    JSON object the lead rank prints after them."""
    if not as_json:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _finish(plan: Plan, versions: dict, checks: list, ranks, timed_out: bool, world: int, as_json: bool,
            log_tail: str = "", stopped: Optional[Stopped] = None) -> int:
    ordered = list(checks) + [report.skipped(n, why) for n, why in plan.skipped.items()]
    ordered.sort(key=lambda c: list(CHECKS).index(c["name"]))
    result = report.assemble(plan, versions, ordered, ranks, timed_out, world, stopped and stopped.signum)
    if stopped is not None:   # one line; the JSON report still goes to stdout for --json
        print(f"npu-fsdp-patches self-test: stopped by {stopped}: killed the launcher and its "
              f"{plan.nproc_per_node} rank(s), removed the temporary files (exit {result['exit_code']})",
              file=sys.stderr, flush=True)
        if as_json:
            print(json.dumps(result, indent=2, default=str))
        return result["exit_code"]
    if log_tail and any(r["state"] not in ("finished",) for r in ranks or []):
        _emit("--- torch.distributed.run output (tail) ---\n" + log_tail.strip(), as_json)
    for c in result["checks"]:
        if c["status"] == "skipped":
            _emit(report.check_line(c), as_json)
    _emit(report.summary(result), as_json)
    if as_json:
        print(json.dumps(result, indent=2, default=str))
    return result["exit_code"]


def _run_launched(plan: Plan, versions: dict, as_json: bool) -> int:
    from .launcher import launch  # pylint: disable=import-outside-toplevel

    _emit(report.header({"versions": versions, "world_size": plan.nproc_per_node, "device": plan.device,
                         "backend": plan.backend}), as_json)
    if not plan.checks:
        return _finish(plan, versions, [], None, False, plan.nproc_per_node, as_json)
    checks, ranks, timed_out, log_tail, stopped = launch(plan, lambda c: _emit(report.check_line(c), as_json))
    if stopped is not None:
        return _finish(plan, versions, checks, ranks, False, plan.nproc_per_node, as_json, stopped=stopped)
    for c in checks:  # progress showed only the checks every rank finished
        if c["status"] == "not run":
            c["reason"] = "not every rank finished it"
        if c["reason"]:
            _emit(report.check_line(c), as_json)
    return _finish(plan, versions, checks, ranks, timed_out, plan.nproc_per_node, as_json, log_tail)


# Set once a rank of a torchrun job has run and reported its checks: the command's process entry then ends
# without interpreter teardown (see cli.commands.main); an in-process caller of main() still gets the code.
RAN_IN_JOB = False


def _run_in_job(plan: Plan, versions: dict, as_json: bool) -> int:
    """Every rank of the job runs this; rank 0 prints. A watchdog ends a rank still here at --timeout."""
    from .rank import StatusFile, run_rank  # pylint: disable=import-outside-toplevel

    job = job_env()
    status = StatusFile("", job["rank"])
    _start_watchdog(plan.timeout, job["rank"], status)
    lead = job["rank"] == 0
    if lead:
        _emit(report.header({"versions": versions, "world_size": job["world_size"], "device": plan.device,
                             "backend": plan.backend}), as_json)

    def on_result(name: str, per_rank: list) -> None:
        _emit(report.check_line(report.merge(name, per_rank)), as_json)

    with _stdout_kept_for_json(as_json):
        every = run_rank(plan, on_result=on_result if lead else None, status=status) if plan.checks else []
    checks = [report.merge(name, per_rank) for name, per_rank in zip(plan.checks, every)]
    ranks = [{"rank": r, "state": "finished", "check": None, "last_finished": plan.checks[-1] if plan.checks else None,
              "seconds_in_check": None, "error": None}
             for r in range(job["world_size"])]
    global RAN_IN_JOB  # pylint: disable=global-statement
    RAN_IN_JOB = True
    return _finish(plan, versions, checks, ranks, False, job["world_size"], as_json) if lead else _exit_code(checks)


def _exit_code(checks: list) -> int:
    """A rank other than 0 inside a job: rank 0's rule, so a skipped check fails no rank."""
    return 0 if report.checks_passed(checks) else 1


def _start_watchdog(timeout: float, rank: int, status) -> None:
    """Inside a job nobody else can kill this rank: past ``timeout`` it says where it was and exits (124)."""
    def expire() -> None:
        where = status.data["current"]
        print(f"npu-fsdp-patches self-test: rank {rank} timed out after {timeout:g} s"
              f"{f' in check {where}' if where else ''}; exiting", file=sys.stderr, flush=True)
        os._exit(report.EXIT_TIMEOUT)
    timer = threading.Timer(timeout, expire)
    timer.daemon = True
    timer.start()
