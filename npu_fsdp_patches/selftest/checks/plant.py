"""Test-only planted faults: the negative controls of the self-test (never set in production).

``NPU_FSDP_PATCHES_SELF_TEST_PLANT`` is a comma list. ``<check>`` makes the engine hand that check a
comparison whose first bitwise comparison sees the result one ulp off (:mod:`.compare`), so the check
must fail; ``hang:<rank>`` makes that rank start a sleeping child of its own (in a new session, like
a compile worker would be) and sleep at the start of its first check, and ``die:<rank>`` makes it
exit there, so the launcher must report the rank and leave nothing running.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

ENV = "NPU_FSDP_PATCHES_SELF_TEST_PLANT"


def _items() -> list:
    return [item.strip() for item in os.environ.get(ENV, "").split(",") if item.strip()]


def planted(check: str) -> bool:
    return check in _items()


def misbehave(rank: int) -> None:
    """Hang or die here when this rank is named by ``hang:<rank>`` / ``die:<rank>``."""
    if f"die:{rank}" in _items():
        os._exit(3)
    if f"hang:{rank}" in _items():
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"],  # pylint: disable=consider-using-with
                         start_new_session=True, stdin=subprocess.DEVNULL)
        while True:
            time.sleep(60)
