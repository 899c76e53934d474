"""Check ``adamw_step``, the single-process subset of the self-test (also ``doctor --self-test``).

On one device, single process, for bf16 and fp32 params it runs 50 AdamW steps with grads from far
below one bf16 ulp up to O(1) and compares, bit for bit after every step, ``foreach_adamw_step``
with the reference ``torch.optim.AdamW(foreach=True)`` (the aten ``_foreach_*`` kernels torch FSDP2
runs on its local shards). For information it also counts how far two wrong paths drift from the
reference on this device (docs/hyper_parallel.md#18-issue-700): torch's single-tensor path (what a
stock step picks for hyper-parallel DTensors) and fp32 math followed by ``.to(dtype)``.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from npu_fsdp_patches.optim import foreach_adamw_step

from .compare import Comparison
from .context import Context
from .plant import planted

NAME = "adamw_step"
ORDER = 10
SCHEMA_VERSION = 1
STEPS = 50
SHAPES = ((64, 33), (7,), (1,), (3, 5))
HYPER = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


def run(ctx: Context) -> dict:
    """The check on this rank's device, in the multi-rank report's terms."""
    report = run_self_test(str(ctx.device), plant=ctx.planted)
    dtypes = report["dtypes"].values()
    first = next((d["first_mismatch"] for d in dtypes if d["first_mismatch"]), None)
    if first is not None:
        first = {"what": f"step {first['step']} {first['tensor']}", "index": first["index"],
                 "expected": first["expected"], "got": first["got"]}
    return {"passed": report["passed"], "elements": sum(d["elements"] for d in dtypes),
            "mismatches": sum(d["mismatches"] for d in dtypes), "max_abs_error": None,
            "first_mismatch": first, "tolerance": "bitwise", "steps": report["steps"]}


def run_self_test(device: Optional[str] = None, plant: Optional[bool] = None) -> dict:
    """Run the check on ``device`` (default: the detected accelerator, else cpu); a JSON-ready report.

    ``plant`` (default: the engine's ``NPU_FSDP_PATCHES_SELF_TEST_PLANT`` names ``adamw_step``) makes
    it a negative control. Schema (``schema_version`` 1, doctor's ``self_test``; docs/self_test.md)::

        {"schema_version": 1, "device": "npu:0", "torch": "2.8.0", "steps": 50, "passed": bool,
         "reference": str, "dtypes": {"bfloat16": DTYPE, "float32": DTYPE}}
        DTYPE = {"passed": bool, "elements": int, "mismatches": int,
                 "first_mismatch": null | {"step": int, "tensor": "exp_avg[1]", "index": [i, ...],
                                            "expected": float, "got": float,
                                            "expected_bits": "0x3c23", "got_bits": "0x3c24"},
                 "single_tensor_mismatches": int, "fp32_then_round_mismatches": int}

    ``passed`` is true when every dtype has 0 mismatches; the two ``*_mismatches`` counters of the
    wrong paths are informational (cumulative over steps and tensors; 0 is possible on CPU).
    """
    from ..options import detect_device  # pylint: disable=import-outside-toplevel

    target = torch.device(device or detect_device(torch))
    plant = planted(NAME) if plant is None else plant
    report = {"schema_version": SCHEMA_VERSION, "device": str(target), "torch": torch.__version__,
              "steps": STEPS, "reference": "torch.optim.AdamW(foreach=True) on the same device",
              "dtypes": {}}
    for dtype in (torch.bfloat16, torch.float32):
        report["dtypes"][str(dtype).replace("torch.", "")] = _check_dtype(target, dtype, plant)
        plant = False
    report["passed"] = all(d["passed"] for d in report["dtypes"].values())
    return report


def _check_dtype(device: torch.device, dtype: torch.dtype, plant: bool) -> dict:
    start = _initial_params()
    runs = {name: [t.to(device=device, dtype=dtype).requires_grad_() for t in start]
            for name in ("reference", "candidate", "single", "fp32")}
    optims = {"reference": torch.optim.AdamW(runs["reference"], foreach=True, **HYPER),
              "candidate": torch.optim.AdamW(runs["candidate"], **HYPER),
              "single": torch.optim.AdamW(runs["single"], foreach=False, **HYPER),
              "fp32": torch.optim.AdamW(runs["fp32"], **HYPER)}
    cmp, single, fp32 = Comparison(plant=plant), Comparison(), Comparison()
    first_step = None
    for step in range(1, STEPS + 1):
        for index, grad in enumerate(_grads(step)):
            for params in runs.values():
                params[index].grad = grad.to(device=device, dtype=dtype)
        optims["reference"].step()
        foreach_adamw_step(optims["candidate"])
        optims["single"].step()
        _fp32_then_round_step(optims["fp32"])
        ref = optims["reference"]
        for index, (p_ref, p_new) in enumerate(zip(runs["reference"], runs["candidate"])):
            cmp.exact(f"param[{index}]", p_ref, p_new)
            for key in ("exp_avg", "exp_avg_sq"):
                cmp.exact(f"{key}[{index}]", ref.state[p_ref][key], optims["candidate"].state[p_new][key])
            single.exact("param", p_ref, runs["single"][index])
            fp32.exact("param", p_ref, runs["fp32"][index])
        if cmp.first is not None and first_step is None:
            first_step = step
    first = cmp.first and {"step": first_step, "tensor": cmp.first["what"],
                           **{k: v for k, v in cmp.first.items() if k != "what"}}
    return {"passed": cmp.mismatches == 0, "elements": sum(t.numel() for t in start),
            "mismatches": cmp.mismatches, "first_mismatch": first,
            "single_tensor_mismatches": single.mismatches, "fp32_then_round_mismatches": fp32.mismatches}


def _initial_params() -> list:
    gen = torch.Generator().manual_seed(42)
    out = []
    for shape in SHAPES:
        magnitude = torch.pow(10.0, -3 * torch.rand(shape, generator=gen))
        out.append(magnitude * torch.randn(shape, generator=gen).sign())
    return out


def _grads(step: int) -> list:
    """Grads from 1e-10 (far below one bf16 ulp of any param) up to O(1), made on CPU for determinism."""
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.pow(10.0, -10 * torch.rand(s, generator=gen)) * torch.randn(s, generator=gen).sign()
            for s in SHAPES]


@torch.no_grad()
def _fp32_then_round_step(optimizer: torch.optim.AdamW) -> None:
    """The rejected fix (docs/hyper_parallel.md#18-issue-700): AdamW maths in fp32, then ``.to(dtype)``
    of param and moments."""
    for group in optimizer.param_groups:
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            state = optimizer.state[p]
            if not state:
                state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
            state["step"] += 1
            p32, g32 = p.float(), p.grad.float()
            m32, v32 = state["exp_avg"].float(), state["exp_avg_sq"].float()
            p32.mul_(1 - group["lr"] * group["weight_decay"])
            m32.lerp_(g32, 1 - beta1)
            v32.mul_(beta2).addcmul_(g32, g32, value=1 - beta2)
            denom = (v32.sqrt() / math.sqrt(1 - beta2 ** state["step"])).add_(group["eps"])
            p32.addcdiv_(m32, denom, value=-group["lr"] / (1 - beta1 ** state["step"]))
            p.copy_(p32)
            state["exp_avg"].copy_(m32)
            state["exp_avg_sq"].copy_(v32)
