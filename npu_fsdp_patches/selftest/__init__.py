"""``npu-fsdp-patches self-test``: check every enabled patch on this machine's devices and backend.

Launched from a shell it starts the ranks with the installed torch's own launcher (one node); run
inside an existing ``torchrun`` job or ``srun`` step it uses that job's ranks. Importing this package
imports no torch: torch is imported when the command runs.
"""
from __future__ import annotations

from .options import EXIT_BAD_OPTIONS, add_arguments
from .runner import main

__all__ = ["add_arguments", "main", "EXIT_BAD_OPTIONS"]
