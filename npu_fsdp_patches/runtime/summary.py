"""The one activation summary line per process (NPU_FSDP_PATCHES_LOG=info; docs/cli.md#activation-summary).

When: once, at the first moment no enabled patch is pending any more (at activation when nothing
waits; else when the training script imports the last target module), or at interpreter exit for
patches whose targets were never imported. Where: one process per job (job_log.py): not torchrun's
agent, not a rank other than 0, not a child (a DataLoader worker) of the process that logs it. Without
activation (``owned`` unset) only ``RANK`` decides, read from the environment (torch is not imported).
"""
from __future__ import annotations

import atexit
import os
import threading
from typing import Callable

from ..plugin_log import log

_ORDER = ("applied", "skipped", "failed", "reverted", "pending")


def summary_line(records: list) -> str:
    """``npu_fsdp_patches: 2 of 7 patches enabled: applied a, b; pending c (waits for import of m)``."""
    enabled = [r for r in records if r["decision"] == "enabled"]
    head = f"npu_fsdp_patches: {len(enabled)} of {len(records)} patches enabled"
    if not enabled:
        return head
    parts = []
    for state in _ORDER:
        names = []
        for r in enabled:
            if r["state"] != state:
                continue
            waits = (f" (waits for import of {', '.join(r['waiting_for'])})"
                     if state == "pending" and r["waiting_for"] else "")
            names.append(r["name"] + waits)
        if names:
            parts.append(f"{state} {', '.join(names)}")
    return f"{head}: {'; '.join(parts)}"


def _rank_zero() -> bool:
    rank = os.environ.get("RANK", "0").strip() or "0"
    return rank == "0"


class ActivationSummary:
    """Logs :func:`summary_line` once per process; ``read_records`` returns the status records."""

    def __init__(self) -> None:
        self.owned: bool | None = None   # set at activation: this process logs the job's line
        self._done = False
        self._lock = threading.Lock()
        self._exit_hook = False

    def logs_here(self) -> bool:
        """This process logs the summary (and the per-target INFO lines)."""
        return _rank_zero() if self.owned is None else self.owned

    def detail_level(self) -> int:
        """The level of a per-target line: INFO where the summary is logged, else DEBUG."""
        return 20 if self.logs_here() else 10

    def update(self, read_records: Callable[[], list], final: bool = False) -> None:
        """Log the line if every enabled patch has settled (or ``final``); a no-op after the first."""
        if self._done or not log.is_enabled_for(20) or not self.logs_here():
            return
        records = read_records()
        settled = not any(r["decision"] == "enabled" and r["state"] == "pending" for r in records)
        with self._lock:
            if self._done:
                return
            if not (settled or final):
                if not self._exit_hook:
                    self._exit_hook = True
                    atexit.register(self.update, read_records, True)
                return
            self._done = True
        log.info("%s", summary_line(records))
