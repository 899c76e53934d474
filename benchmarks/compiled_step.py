"""Optimizer step time, compiled against eager against torch's own, for each optimizer we ship, in one run.

    python benchmarks/compiled_step.py [--device cpu|cuda|npu] [--backend inductor] [--params N]
                                       [--numel N] [--steps N] [--quick] [--json]

One process, plain tensors (``--params`` x ``--numel`` elements, default 8 x 256k). Three families, each
stepped round-robin on the same data, each variant ``torch.compile(step, backend=--backend)`` and eager:
  foreach      torch ``AdamW(foreach=True).step``        vs ``foreach_adamw_step`` (fp32)
  fused        torch ``AdamW(fused=True).step``          vs ``FusedAdam.step`` (fp32)
  main_params  torch ``AdamW(foreach=True)`` on fp32 params vs ``MainParamsOptimizer`` over that AdamW on
               bf16 params with bf16 grads (the cast, the step on fp32 main params, the copy back)
Times are medians of the timed steps after warm-up (compilation is in the warm-up): the stepping
thread's CPU time with one thread on cpu, wall time with the device synchronised around each step
elsewhere; each variant
runs as one block (see ``measure``). Prints a table of milliseconds and the ratios ours/torch (same
mode) and compiled/eager; ``--json`` prints the same machine-readable. ``--quick`` shrinks everything to
a smoke run (the CPU path of benchmarks/device_run.sh's test).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._device import add_device_arguments, clock, rank_device, synchronize  # noqa: E402


def _variants(device: str, params: int, numel: int):
    """{family: {variant: (step callable, before-step callable)}}; before-step re-attaches grads where a
    step consumes them (MainParamsOptimizer moves a model param's grad to its main param)."""
    import torch
    from torch import nn

    from npu_fsdp_patches.optim import FusedAdam, MainParamsOptimizer, foreach_adamw_step

    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(numel, generator=gen).to(device) for _ in range(params)]
    grads = [(torch.randn(numel, generator=gen) * 1e-3).to(device) for _ in range(params)]
    hyper = dict(lr=1e-3, weight_decay=0.01)

    def fp32_params():
        out = [nn.Parameter(v.clone()) for v in values]
        for p, g in zip(out, grads):
            p.grad = g
        return out

    nothing = lambda: None
    families = {}
    torch_foreach = torch.optim.AdamW(fp32_params(), foreach=True, **hyper)
    ours_foreach = torch.optim.AdamW(fp32_params(), foreach=True, **hyper)
    families["foreach"] = {"torch": (torch_foreach.step, nothing),
                           "ours": (lambda: foreach_adamw_step(ours_foreach), nothing)}
    torch_fused = torch.optim.AdamW(fp32_params(), fused=True, **hyper)
    ours_fused = FusedAdam(fp32_params(), **hyper)
    families["fused"] = {"torch": (torch_fused.step, nothing), "ours": (ours_fused.step, nothing)}

    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.weights = nn.ParameterList(nn.Parameter(v.to(torch.bfloat16)) for v in values)

    model = Flat()
    bf16_grads = [g.to(torch.bfloat16) for g in grads]
    wrapper = MainParamsOptimizer(torch.optim.AdamW(model.parameters(), foreach=True, **hyper), model)

    def attach():
        for p, g in zip(model.parameters(), bf16_grads):
            p.grad = g

    torch_fp32 = torch.optim.AdamW(fp32_params(), foreach=True, **hyper)
    families["main_params"] = {"torch": (torch_fp32.step, nothing), "ours": (wrapper.step, attach)}
    return families


def _time(step, before, device: str, steps: int, warmup: int) -> float:
    """Median step time: the stepping thread's CPU time on cpu (one thread; a loaded machine disturbs it far less than
    wall time), wall time with the device synchronised elsewhere."""
    now = clock(device)
    times = []
    for i in range(warmup + steps):
        before()
        synchronize(device)
        start = now()
        step()
        synchronize(device)
        if i >= warmup:
            times.append(now() - start)
    return statistics.median(times)


def measure(device: str, backend: str, params: int, numel: int, steps: int, warmup: int) -> dict:
    """Each variant timed in its own block, dynamo reset before each compiled one: on torch 2.13 a second
    ``AdamW(foreach=True)`` compiled in the same process fails in its resumed frame ("Expected scalars to
    be on CPU, got meta"), torch's own optimizer included, so compiled variants cannot be interleaved."""
    import torch._dynamo

    families = _variants(str(rank_device(device, 0)), params, numel)   # one thread on cpu; npu registered
    results = {}
    for family, variants in families.items():
        row = {}
        for who, (step, before) in variants.items():
            row[f"{who}_eager_ms"] = 1e3 * _time(step, before, device, steps, warmup)
            torch._dynamo.reset()
            compiled = torch.compile(step, backend=backend)
            row[f"{who}_compiled_ms"] = 1e3 * _time(compiled, before, device, steps, warmup)
            torch._dynamo.reset()
        row["ours/torch eager"] = row["ours_eager_ms"] / row["torch_eager_ms"]
        row["ours/torch compiled"] = row["ours_compiled_ms"] / row["torch_compiled_ms"]
        row["ours compiled/eager"] = row["ours_compiled_ms"] / row["ours_eager_ms"]
        row["torch compiled/eager"] = row["torch_compiled_ms"] / row["torch_eager_ms"]
        results[family] = row
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_arguments(parser, ranks=False)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--params", type=int, default=8)
    parser.add_argument("--numel", type=int, default=256 * 1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few steps, aot_eager")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.params, args.numel, args.steps, args.warmup = 2, 1024, 2, 2
        args.backend = "aot_eager"
    results = measure(args.device, args.backend, args.params, args.numel, args.steps, args.warmup)
    if args.json:
        print(json.dumps({"device": args.device, "backend": args.backend, "params": args.params,
                          "numel": args.numel, "steps": args.steps, "results": results}, indent=1))
        return
    print(f"compiled_step: {args.params} x {args.numel} elements on {args.device}, backend {args.backend}, "
          f"median of {args.steps} steps (ms)")
    head = ["torch_eager_ms", "torch_compiled_ms", "ours_eager_ms", "ours_compiled_ms", "ours/torch eager",
            "ours/torch compiled", "ours compiled/eager", "torch compiled/eager"]
    print(f"{'family':<12}" + "".join(f"{h:>21}" for h in head))
    for family, row in results.items():
        print(f"{family:<12}" + "".join(f"{row[h]:>21.3f}" for h in head))


if __name__ == "__main__":
    main()
