"""Launch the ranks with the installed torch's own launcher and watch them until done or timed out.

``python -m torch.distributed.run --standalone --nproc-per-node N -m npu_fsdp_patches.selftest.rank``
runs in a new session; the ranks' status files give progress and, when the time is up or a rank
dies, name each rank and the check it was in. On the way out the whole process group is killed and
every rank process by pid, so nothing is left running.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from typing import Callable

from . import report
from .options import Plan

POLL_S = 0.2
TERM_GRACE_S = 5.0
ROOT_CAUSE = re.compile(r"Root Cause \(first observed failure\):.*?\n.*?rank\s*:\s*(\d+)", re.S)


def _read_status(folder: str, nproc: int) -> list:
    out = []
    for rank in range(nproc):
        try:
            with open(os.path.join(folder, f"rank{rank}.json"), encoding="utf-8") as fh:
                out.append(json.load(fh))
        except (OSError, ValueError):
            out.append(None)
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped by torchrun) is not running
        with open(f"/proc/{pid}/stat", encoding="utf-8") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _children(parent: int) -> set:
    """Pids whose parent is ``parent`` (Linux /proc; torchrun starts each rank in its own session)."""
    found = set()
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as fh:
                if int(fh.read().rsplit(")", 1)[1].split()[1]) == parent:
                    found.add(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return found


def _stop(proc: subprocess.Popen, statuses: list) -> None:
    """SIGTERM torchrun (it stops its ranks), then SIGKILL its group and every rank still there."""
    ranks = _children(proc.pid) | {s["pid"] for s in statuses if s}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        for pid in ranks if sig == signal.SIGKILL else ():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        try:
            proc.wait(timeout=TERM_GRACE_S)
        except subprocess.TimeoutExpired:
            continue
        deadline = time.monotonic() + TERM_GRACE_S
        while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        if not any(_alive(pid) for pid in ranks):
            return


def _first_failure(log: str):
    """The rank torchrun names as the root cause (first observed failure), if any."""
    found = ROOT_CAUSE.search(log)
    return int(found.group(1)) if found else None


def rank_states(statuses: list, alive: list, timed_out: bool, log: str = "") -> list:
    """One entry per rank: finished, hung (alive past the time), died, stopped (by torchrun after
    another rank failed), failed (raised) or not started."""
    now = time.time()
    culprit = None if timed_out else _first_failure(log)
    out = []
    for rank, status in enumerate(statuses):
        entry = {"rank": rank, "state": "not started", "check": None, "last_finished": None,
                 "seconds_in_check": None, "error": None}
        if status is not None:
            entry["check"], entry["last_finished"] = status["current"], status["last"]
            if status["current"] and status["started"]:
                entry["seconds_in_check"] = round(now - status["started"], 1)
            if status["done"]:
                entry["state"] = "finished"
            elif status["error"]:
                entry["state"] = "failed"
                entry["error"] = status["error"].strip().splitlines()[-1]
            else:
                entry["state"] = ("hung" if alive[rank] else "died") if timed_out else \
                    "stopped" if culprit is not None and culprit != rank else "died"
        out.append(entry)
    return out


def launch(plan: Plan, on_check: Callable[[dict], None]) -> tuple:
    """Run ``plan`` on ``plan.nproc_per_node`` local ranks; returns (checks, ranks, timed_out, log tail)."""
    with tempfile.TemporaryDirectory(prefix="npu_fsdp_self_test_") as tmp:
        plan.status_dir = os.path.join(tmp, "status")
        os.makedirs(plan.status_dir)
        if not plan.workdir:
            plan.workdir = os.path.join(tmp, "work")
            os.makedirs(plan.workdir)
        plan_path = os.path.join(tmp, "plan.json")
        with open(plan_path, "w", encoding="utf-8") as fh:
            json.dump(plan.as_dict(), fh)
        log_path = os.path.join(tmp, "launcher.log")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
               "--nproc-per-node", str(plan.nproc_per_node), "-m", "npu_fsdp_patches.selftest.rank", plan_path]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        with open(log_path, "w", encoding="utf-8") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            deadline = time.monotonic() + plan.timeout
            shown, timed_out = set(), False
            try:
                while True:
                    finished = proc.poll() is not None
                    statuses = _read_status(plan.status_dir, plan.nproc_per_node)
                    _show_progress(plan, statuses, shown, on_check)
                    if finished:
                        break
                    if time.monotonic() > deadline:
                        timed_out = True
                        break
                    time.sleep(POLL_S)
                alive = [bool(s) and _alive(s["pid"]) for s in statuses]
            finally:
                _stop(proc, _read_status(plan.status_dir, plan.nproc_per_node))
        statuses = _read_status(plan.status_dir, plan.nproc_per_node)
        with open(log_path, encoding="utf-8", errors="replace") as fh:
            log_tail = fh.read()[-6000:]
    checks = [report.merge(name, [s and s["results"].get(name) for s in statuses]) for name in plan.checks]
    return checks, rank_states(statuses, alive, timed_out, log_tail), timed_out, log_tail


def _show_progress(plan: Plan, statuses: list, shown: set, on_check: Callable[[dict], None]) -> None:
    """Report each check, in order, once every rank has its result."""
    for name in plan.checks:
        if name in shown:
            continue
        per_rank = [s and s["results"].get(name) for s in statuses]
        if not all(per_rank):
            return
        shown.add(name)
        on_check(report.merge(name, per_rank))
