"""Accumulate one check's comparisons: mismatches, max abs error, first mismatching element."""
from __future__ import annotations

from typing import Optional

import torch


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (a collective for torch DTensors), detached."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


class Comparison:
    """Figures of one check on one rank; ``exact`` comparisons count differing bits."""

    def __init__(self) -> None:
        self.elements = 0
        self.mismatches = 0
        self.max_abs_error = 0.0
        self.first: Optional[dict] = None

    def exact(self, what: str, expected: torch.Tensor, got: torch.Tensor) -> None:
        """Bit-for-bit: an element mismatches when its bits differ (NaN-safe)."""
        self._compare(what, expected, got, None)

    def close(self, what: str, expected: torch.Tensor, got: torch.Tensor, rtol: float, atol: float) -> None:
        """Within tolerance: mismatch when ``|got - expected| > atol + rtol * |expected|``."""
        self._compare(what, expected, got, (rtol, atol))

    def _compare(self, what, expected, got, tolerance) -> None:
        # on the host: some accelerators lack float64 kernels, and the figures need the values anyway
        expected, got = expected.detach().cpu(), got.detach().cpu()
        if expected.shape != got.shape or expected.dtype != got.dtype:
            self.mismatches += max(expected.numel(), 1)
            self._note(what, [], f"{tuple(expected.shape)} {expected.dtype}", f"{tuple(got.shape)} {got.dtype}")
            return
        self.elements += expected.numel()
        if expected.numel() == 0:
            return
        e64, g64 = expected.double().reshape(-1), got.double().reshape(-1)
        error = (g64 - e64).abs()
        self.max_abs_error = max(self.max_abs_error, float(error.max()))
        if tolerance is None:
            bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[expected.element_size()]
            differ = expected.reshape(-1).view(bits) != got.reshape(-1).view(bits)
        else:
            differ = ~(error <= tolerance[1] + tolerance[0] * e64.abs())
        count = int(differ.sum())
        if count:
            self.mismatches += count
            flat = int(differ.nonzero()[0])
            index = [int(i) for i in torch.unravel_index(torch.tensor(flat), expected.shape)]
            self._note(what, index, e64[flat].item(), g64[flat].item())

    def _note(self, what, index, expected, got) -> None:
        if self.first is None:
            self.first = {"what": what, "index": index, "expected": expected, "got": got}

    def result(self, **extra) -> dict:
        return {"passed": self.mismatches == 0, "elements": self.elements, "mismatches": self.mismatches,
                "max_abs_error": self.max_abs_error, "first_mismatch": self.first, **extra}
