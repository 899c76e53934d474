"""Check ``adamw_step``: the single-process bit-exact AdamW step of ``doctor --self-test``, per rank.

Reuses :func:`npu_fsdp_patches.optim.self_test.run_self_test` on this rank's device: 50 steps of
``foreach_adamw_step`` against ``AdamW(foreach=True)``, bf16 and fp32, compared bit for bit.
"""
from __future__ import annotations

import functools

from npu_fsdp_patches.optim import self_test

from .context import Context
from .plant import nudge, planted

NAME = "adamw_step"


def _planted_step(step):
    @functools.wraps(step)
    def wrapper(optimizer):
        step(optimizer)
        nudge(optimizer.param_groups[0]["params"][0])
    return wrapper


def run(ctx: Context) -> dict:
    original = self_test.foreach_adamw_step
    if planted(NAME):
        self_test.foreach_adamw_step = _planted_step(original)
    try:
        report = self_test.run_self_test(str(ctx.device))
    finally:
        self_test.foreach_adamw_step = original
    dtypes = report["dtypes"].values()
    first = next((d["first_mismatch"] for d in report["dtypes"].values() if d["first_mismatch"]), None)
    if first is not None:
        first = {"what": f"step {first['step']} {first['tensor']}", "index": first["index"],
                 "expected": first["expected"], "got": first["got"]}
    return {"passed": report["passed"], "elements": sum(d["elements"] for d in dtypes),
            "mismatches": sum(d["mismatches"] for d in dtypes), "max_abs_error": None,
            "first_mismatch": first, "tolerance": "bitwise", "steps": report["steps"]}
