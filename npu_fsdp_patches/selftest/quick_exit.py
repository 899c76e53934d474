"""End a rank that has reported everything: its exit handlers run, interpreter teardown does not.

gloo's background threads can abort a finished rank during teardown ("terminate called without an active
exception", SIGABRT) and fail a passing run, so a rank ends with ``os._exit``. The exit handlers still run
first, as at a normal exit: torch <= 2.9 removes the temporary folder that importing ``torch.distributed.nn``
makes (torch/distributed/nn/jit/instantiator.py, ``_TEMP_DIR``) only from one, and skipping them left a
``tmp*`` folder per rank in the user's temp directory.
"""
from __future__ import annotations

import atexit
import os
import sys
from typing import NoReturn


def exit_without_teardown(code: int) -> NoReturn:
    """Run the exit handlers, flush, and leave with ``code`` before interpreter teardown."""
    atexit._run_exitfuncs()   # pylint: disable=protected-access  # what a normal exit runs first
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
