"""The self-test's one comparer (the checks, ``doctor --self-test`` and the tests' ``bit_mismatches``).

A :class:`Comparison` accumulates one check's figures: elements, mismatches, max abs error and the
first mismatching element. The engine hands a check a comparison with ``plant=True`` for a negative
control: its first bitwise comparison then sees the system-under-test side one ulp off, which the
check must report as a failure (nothing in product code is swapped for it).
"""
from __future__ import annotations

from typing import Optional

import torch

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (a collective for torch DTensors), detached."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def one_ulp_off(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` whose first element's bit pattern is one higher (one ulp for floats)."""
    out = t.detach().clone()
    flat = out.reshape(-1)
    if flat.numel():
        flat[:1].view(_BITS[flat.element_size()]).add_(1)
    return out


class Comparison:
    """Figures of one check on one rank; ``exact`` comparisons count differing bits."""

    def __init__(self, plant: bool = False) -> None:
        self.elements = 0
        self.mismatches = 0
        self.max_abs_error = 0.0
        self.first: Optional[dict] = None
        self._plant = plant

    def exact(self, what: str, expected: torch.Tensor, got: torch.Tensor) -> None:
        """Bit-for-bit: an element mismatches when its bits differ (NaN-safe)."""
        if self._plant and got.numel():
            self._plant, got = False, one_ulp_off(got)
        self._compare(what, expected, got, None)

    def close(self, what: str, expected: torch.Tensor, got: torch.Tensor, rtol: float, atol: float) -> None:
        """Within tolerance: mismatch when ``|got - expected| > atol + rtol * |expected|``."""
        self._compare(what, expected, got, (rtol, atol))

    def _compare(self, what, expected, got, tolerance) -> None:
        # on the host: some accelerators lack float64 kernels, and the figures need the values anyway
        expected, got = expected.detach().cpu(), got.detach().cpu()
        if expected.shape != got.shape or expected.dtype != got.dtype:
            self.mismatches += max(expected.numel(), got.numel(), 1)
            self._note(what, [], f"{tuple(expected.shape)} {expected.dtype}", f"{tuple(got.shape)} {got.dtype}")
            return
        if expected.is_complex():   # compared as (real, imag) pairs: the index gets a last dim of 2
            expected, got = torch.view_as_real(expected), torch.view_as_real(got)
        self.elements += expected.numel()
        if expected.numel() == 0:
            return
        e64, g64 = expected.double().reshape(-1), got.double().reshape(-1)
        error = (g64 - e64).abs()
        self.max_abs_error = max(self.max_abs_error, float(error.max()))
        bits = _BITS[expected.element_size()]
        e_bits, g_bits = expected.reshape(-1).view(bits), got.reshape(-1).view(bits)
        differ = e_bits != g_bits if tolerance is None else ~(error <= tolerance[1] + tolerance[0] * e64.abs())
        count = int(differ.sum())
        if count:
            self.mismatches += count
            flat = int(differ.nonzero()[0])
            index = [int(i) for i in torch.unravel_index(torch.tensor(flat), expected.shape)] if expected.dim() else []
            mask = (1 << (8 * expected.element_size())) - 1
            self._note(what, index, e64[flat].item(), g64[flat].item(),
                       hex(int(e_bits[flat]) & mask), hex(int(g_bits[flat]) & mask))

    def _note(self, what, index, expected, got, expected_bits=None, got_bits=None) -> None:
        if self.first is None:
            self.first = {"what": what, "index": index, "expected": expected, "got": got,
                          "expected_bits": expected_bits, "got_bits": got_bits}

    def result(self, **extra) -> dict:
        return {"passed": self.mismatches == 0, "elements": self.elements, "mismatches": self.mismatches,
                "max_abs_error": self.max_abs_error, "first_mismatch": self.first, **extra}
