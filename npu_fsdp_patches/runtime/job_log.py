"""One message per job (docs/usage.md#messages): which process of a job says what.

torch autoload activates the plugin in every process of a job: the torchrun agent, each rank, each
DataLoader worker. A configuration message computed from the same environment would repeat in each.
So the first process that says something records it in one environment variable, :data:`MARKER`,
which every child inherits:

    NPU_FSDP_PATCHES_SAID=<writer>;<summary process>;<digest>,<digest>,...

``writer`` is the process that last wrote it, ``summary process`` the one that logs the activation summary,
each ``digest`` a message already logged. A process is named by a *stamp*, ``<pid>.<start time>.<boot id>``
where ``/proc`` gives them (Linux), else ``<pid>``. A child trusts the value only when the writer is itself
or one of its ancestors and, on Linux, the live process of that pid started at the stamped time on the
stamped boot: an environment copied from another job names a dead process, or one whose pid a new process
now holds (PID 1 of every container; pids repeat), which started at another time. A launcher (torchrun's
agent) starts a new job, so it ignores what it inherited. Rules, in one place:

* a configuration message is logged unless an ancestor logged the same text, or this is a rank whose
  ``LOCAL_RANK`` is not 0 (local rank 0 of the node says it);
* the summary line and the per-target "applied at" lines (INFO) come from one process: the first
  non-launcher process with ``RANK`` unset or 0 whose ancestors do not log them; elsewhere those lines
  are DEBUG.
"""
from __future__ import annotations

import os
import sys
from typing import Mapping

from ..plan.settings import SAID_VAR
from ..plugin_log import log

#: the variable children inherit (internal: the settings' misspelling check knows it)
MARKER = SAID_VAR
_LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch")


def _digest(message: str) -> str:
    import hashlib   # only a process with something to say pays for it
    return hashlib.sha256(message.encode("utf-8", "replace")).hexdigest()[:16]


def _proc_stat(pid: int) -> list[str] | None:
    """Fields 3... of ``/proc/<pid>/stat`` (state, ppid, ..., starttime is index 19), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
    except OSError:
        return None
    return stat[stat.rfind(")") + 2:].split()   # the command name may hold spaces and parentheses


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip().replace("-", "")[:12]
    except OSError:
        return ""


def stamp(pid: int) -> str:
    """``<pid>.<start time>.<boot id>`` where ``/proc`` gives them, else ``<pid>``."""
    fields = _proc_stat(pid)
    return f"{pid}.{fields[19]}.{_boot_id()}" if fields and len(fields) > 19 else str(pid)


def _ancestors() -> set[int]:
    """This process and its ancestors (``/proc`` walk; elsewhere this process and its parent)."""
    found, pid = {os.getpid()}, os.getpid()
    for _ in range(256):
        fields = _proc_stat(pid)
        if fields is None:
            return found | {os.getppid()}
        pid = int(fields[1])
        if pid <= 0 or pid in found:
            return found
        found.add(pid)
    return found


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    if os.name != "posix" or pid <= 0:
        return pid > 0     # no signal 0 to probe with: trust the inherited value
    try:
        os.kill(pid, 0)
    except PermissionError:
        return True
    except OSError:
        return False
    return True


def trusted(value: str) -> int:
    """The pid a stamp names if that process is this one or an ancestor and, where ``/proc`` can tell, the very
    process that wrote the stamp (same start time, same boot); else 0."""
    try:
        pid = int(value.split(".")[0])
    except ValueError:
        return 0
    if pid <= 0 or pid not in _ancestors() or not _alive(pid):
        return 0
    return pid if stamp(pid) == value else 0


def is_launcher(argv: list, orig_argv: list) -> bool:
    """torchrun's agent (``torchrun`` or ``python -m torch.distributed.run``/``launch``)."""
    if run_module(orig_argv) in _LAUNCHER_MODULES:
        return True
    first = (argv[0] if argv else "").replace("\\", "/")
    return os.path.basename(first) == "torchrun" or first.endswith("torch/distributed/run.py")


class JobLog:
    """This process's share of the job's messages, read from the environment once at activation."""

    def __init__(self, environ: Mapping[str, str], launcher: bool | None = None) -> None:
        self.environ = environ
        self.launcher = (is_launcher(list(sys.argv), list(getattr(sys, "orig_argv", None) or []))
                         if launcher is None else launcher)
        said, summary_pid = set(), 0
        if not self.launcher:
            parts = environ.get(MARKER, "").split(";")
            if len(parts) == 3 and trusted(parts[0]):
                said, summary_pid = {d for d in parts[2].split(",") if d}, trusted(parts[1])
        self.said = said
        rank = (environ.get("RANK", "0").strip() or "0") == "0"
        inherited = summary_pid and summary_pid != os.getpid()
        self.owns_summary = rank and not self.launcher and not inherited
        self.summary_pid = os.getpid() if self.owns_summary else summary_pid
        self.local_rank_zero = (environ.get("LOCAL_RANK", "0").strip() or "0") == "0"
        self._export()

    def config(self, level: int, message: str) -> None:
        """Log a configuration message unless an ancestor or local rank 0 says it. A message this
        process's logger drops (an INFO line at the default level) is not recorded as said."""
        if not log.is_enabled_for(level):
            return
        digest = _digest(message)
        if digest in self.said or not self.local_rank_zero:
            return
        self.said.add(digest)
        log.log(level, "%s", message)
        self._export()

    def _export(self) -> None:
        """Hand what was said to children; only into the real environment of this process."""
        if self.environ is not os.environ:
            return
        summary = stamp(self.summary_pid) if self.summary_pid else ""
        value = f"{stamp(os.getpid())};{summary};{','.join(sorted(self.said))}"
        if os.environ.get(MARKER) != value:
            os.environ[MARKER] = value


def run_module(argv: list) -> str | None:
    """The module ``python [options] -m MODULE`` runs, however the options are spelled (``-mMOD``,
    ``-Im MOD``, ``-X opt -m MOD``); None for ``-c`` or a script."""
    args = iter(argv[1:])
    for arg in args:
        if not arg.startswith("-") or arg in ("-", "--"):
            return None
        for i, flag in enumerate(arg[1:], 1):
            if flag in "WX" or flag in "mc":          # the rest of the word, or the next one, is its value
                value = arg[i + 1:] or next(args, "")
                if flag in "mc":
                    return value if flag == "m" else None
                break
    return None
