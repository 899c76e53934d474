"""Test-only planted bugs: the negative controls of the self-test (never set in production).

``NPU_FSDP_PATCHES_SELF_TEST_PLANT`` is a comma list. ``<check>`` moves one element of that check's
system-under-test side by one ulp, so the check must fail; ``hang:<rank>`` makes that rank sleep at
the start of its first check and ``die:<rank>`` makes it exit, so the launcher must report the rank.
"""
from __future__ import annotations

import os
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
        while True:
            time.sleep(60)


def nudge(tensor) -> None:
    """Move the first local element of ``tensor`` (a param, a state, a DTensor) by one ulp in place."""
    import torch  # pylint: disable=import-outside-toplevel

    local = tensor._local_tensor if hasattr(tensor, "_local_tensor") else tensor
    flat = local.detach().reshape(-1)
    if flat.numel() == 0:
        return
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    with torch.no_grad():
        flat[:1].view(bits).add_(1)
