"""Launch the ranks with the installed torch's own launcher and watch them until done or timed out.

``python -m torch.distributed.run --standalone --nproc-per-node N -m npu_fsdp_patches.selftest.rank``
runs in a new session; the ranks' status files give progress and, when the time is up or a rank
dies, name each rank and the check it was in. Every process of the run carries a run marker in its
environment; on the way out (done, timed out, or stopped by a signal) the launcher's group, its
descendants and every marked process are killed and the temporary files removed, so nothing is left.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Callable

from . import report
from .options import POD_VARS, Plan

POLL_S = 0.2
TERM_GRACE_S = 5.0
#: in every process of a launched run (the ranks and anything they start): how the run is found and ended
RUN_ENV = "NPU_FSDP_PATCHES_SELF_TEST_RUN"
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


def _processes() -> dict:
    """pid -> (parent pid, environment bytes) of every process this user can read (Linux /proc)."""
    found = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as fh:
                parent = int(fh.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/environ", "rb") as fh:
                found[int(entry)] = (parent, fh.read())
        except (OSError, ValueError, IndexError):
            continue
    return found


def run_processes(launcher_pid, run_id: str) -> set:
    """The launcher, every descendant of it, and every process carrying this run's marker in its
    environment (a rank's child in a new session whose parent already died keeps the marker)."""
    table = _processes()
    marker = f"{RUN_ENV}={run_id}".encode()
    found = {pid for pid, (_, environ) in table.items() if marker in environ.split(b"\0")}
    if launcher_pid is not None:
        found.add(launcher_pid)
    grew = True
    while grew:
        more = {pid for pid, (parent, _) in table.items() if parent in found} - found
        found |= more
        grew = bool(more)
    found.discard(os.getpid())
    return found


def _signal_all(pids: set, sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _stop(proc, run_id: str) -> None:
    """SIGTERM the launcher's group (torchrun stops its ranks), then SIGKILL whatever of the run is
    left: the group, every descendant and every process with the run marker, until none is alive."""
    if proc is not None and proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=TERM_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
    deadline = time.monotonic() + TERM_GRACE_S
    while True:
        left = {pid for pid in run_processes(proc.pid if proc else None, run_id) if _alive(pid)}
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _signal_all(left, signal.SIGKILL)
        if proc is not None:
            try:
                proc.wait(timeout=POLL_S)
            except subprocess.TimeoutExpired:
                pass
        if not left or time.monotonic() > deadline:
            return
        time.sleep(POLL_S)


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


#: the signals that stop a run: it kills its ranks, removes its files and exits 128 + the signal
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP", "SIGINT") if hasattr(signal, name))


@contextlib.contextmanager
def _signals_held():
    """Hold STOP_SIGNALS back while the run is being cleaned up (delivered when the block ends)."""
    hold = getattr(signal, "pthread_sigmask", None)
    previous = hold(signal.SIG_BLOCK, STOP_SIGNALS) if hold else None
    try:
        yield
    finally:
        if hold:
            hold(signal.SIG_SETMASK, previous)


class Stopped(Exception):
    """Raised by the signal handler the runner installs: stop the run, clean up, exit 128+signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def launch(plan: Plan, on_check: Callable[[dict], None]) -> tuple:
    """Run ``plan`` on ``plan.nproc_per_node`` local ranks; returns (checks, ranks, timed_out, log tail,
    stopped: the :class:`Stopped` that ended the run early, or None). Every process of the run is
    gone and the temporary files removed when it returns."""
    plan.run_id = plan.run_id or uuid.uuid4().hex
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
        # a pod's rendezvous variables are for a multi-node job, not for these local ranks
        env = {k: v for k, v in os.environ.items() if k not in POD_VARS}
        # the run's own TMPDIR: what torchrun and the ranks put there goes with this folder
        os.makedirs(os.path.join(tmp, "tmp"))
        env.update({"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), RUN_ENV: plan.run_id,
                    "TMPDIR": os.path.join(tmp, "tmp")})
        timed_out, stopped, proc, alive, statuses = False, None, None, [], []
        with open(log_path, "w", encoding="utf-8") as log:
            try:
                proc = subprocess.Popen(  # pylint: disable=consider-using-with  (_stop ends it)
                    cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
                timed_out, statuses = _watch(proc, plan, on_check)
                alive = [bool(s) and _alive(s["pid"]) for s in statuses]
            except Stopped as exc:
                stopped = exc
            finally:
                with _signals_held():   # a signal now is handled once everything is cleaned up
                    _stop(proc, plan.run_id)
                    shutil.rmtree(os.path.join(plan.workdir, f"npu_fsdp_self_test_{plan.run_id}"),
                                  ignore_errors=True)
        statuses = _read_status(plan.status_dir, plan.nproc_per_node)
        with open(log_path, encoding="utf-8", errors="replace") as fh:
            log_tail = fh.read()[-6000:]
    checks = [report.merge(name, [s and s["results"].get(name) for s in statuses]) for name in plan.checks]
    alive = alive or [False] * plan.nproc_per_node
    return checks, rank_states(statuses, alive, timed_out, log_tail), timed_out, log_tail, stopped


def _watch(proc: subprocess.Popen, plan: Plan, on_check: Callable[[dict], None]) -> tuple:
    """Show progress until the launcher exits or the time is up; returns (timed out, statuses)."""
    deadline = time.monotonic() + plan.timeout
    shown = set()
    while True:
        finished = proc.poll() is not None
        statuses = _read_status(plan.status_dir, plan.nproc_per_node)
        _show_progress(plan, statuses, shown, on_check)
        if finished:
            return False, statuses
        if time.monotonic() > deadline:
            return True, statuses
        time.sleep(POLL_S)


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
