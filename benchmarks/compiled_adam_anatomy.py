"""Why the compiled main-params step is not at a memory-traffic limit on CPU (docs/performance.md#current-figures).

    python benchmarks/compiled_adam_anatomy.py [--sizes 8x524288,8x4194304] [--steps 30] [--json]

One process, one thread, plain tensors, inductor, the CPU time of the stepping thread (not the compile
workers'). Two measurements, each variant stepped interleaved:
  sizes       torch's compiled fp32 ``AdamW(foreach=True)`` against the compiled ``MainParamsOptimizer`` over
              the same AdamW on bf16 params (bf16 grad; fp32 ``main_grad``), in ns per element, at sizes
              inside and beyond the last-level cache: a memory-bound kernel slows down past the cache.
  bias        one compiled Adam update with its bias corrections as step tensors (what every compiled
              torch optimizer runs, ``capturable=True``: inductor recomputes them per vector) against the
              same update with them as Python floats, in ns per element.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._device import clock  # noqa: E402

now = clock("cpu")   # the stepping thread's CPU time


def _median_ns_per_element(steps: dict, numel: int, repeats: int) -> dict:
    """{name: (step, before)} stepped interleaved after a warm-up; median ns per element each."""
    for step, before in steps.values():
        for _ in range(3):
            before()
            step()
    times = {name: [] for name in steps}
    for _ in range(repeats):
        for name, (step, before) in steps.items():
            before()
            start = now()
            step()
            times[name].append(now() - start)
    return {name: statistics.median(t) / numel * 1e9 for name, t in times.items()}


def sizes(count: int, numel: int, repeats: int) -> dict:
    import torch
    from torch import nn

    from npu_fsdp_patches.optim import MainParamsOptimizer

    def variant(kind: str):
        model = nn.Module()
        dtype = torch.float32 if kind == "torch" else torch.bfloat16
        gen = torch.Generator().manual_seed(0)
        for i in range(count):
            model.register_parameter(f"w{i}", nn.Parameter(torch.randn(numel, generator=gen).to(dtype)))
        leaf = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        opt = leaf if kind == "torch" else MainParamsOptimizer(leaf, model)
        grads = [torch.randn(numel, generator=gen, dtype=torch.float32 if kind == "main_grad" else dtype) * 1e-3
                 for _ in range(count)]

        def before():
            opt.zero_grad()
            for p, g in zip(model.parameters(), grads):
                if kind == "main_grad":
                    p.main_grad = g
                else:
                    p.grad = g
        return torch.compile(opt.step), before

    steps = {}
    for kind in ("torch", "bf16_grad", "main_grad"):   # each compiled in a fresh dynamo
        torch._dynamo.reset()
        steps[kind] = variant(kind)
        _median_ns_per_element({kind: steps[kind]}, count * numel, 1)
    out = _median_ns_per_element(steps, count * numel, repeats)
    out["ratio_bf16_grad"] = out["bf16_grad"] / out["torch"]
    out["ratio_main_grad"] = out["main_grad"] / out["torch"]
    return out


def bias(numel: int, repeats: int) -> dict:
    import torch

    def update(p, g, m, v, step, tensor_corrections: bool):
        m.lerp_(g, 0.1)
        v.mul_(0.999).addcmul_(g, g, value=0.001)
        if tensor_corrections:
            bc1, bc2 = 1 - torch.pow(0.9, step), 1 - torch.pow(0.999, step)
            p.sub_((1e-3 / bc1) * m / (v.sqrt() / bc2.sqrt() + 1e-8))
        else:
            bc1, bc2 = 1 - 0.9 ** 5, 1 - 0.999 ** 5
            p.sub_((1e-3 / bc1) * m / (v.sqrt() / bc2 ** 0.5 + 1e-8))

    gen = torch.Generator().manual_seed(0)
    p, g, m = (torch.randn(numel, generator=gen) for _ in range(3))
    v = torch.rand(numel, generator=gen)
    step = torch.tensor(5.0)
    torch._dynamo.reset()
    compiled = torch.compile(update)
    nothing = lambda: None  # noqa: E731
    return _median_ns_per_element({
        "step_tensors": (lambda: compiled(p, g, m, v, step, True), nothing),
        "python_floats": (lambda: compiled(p, g, m, v, step, False), nothing)}, numel, repeats)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="8x524288,8x4194304", help="COUNTxNUMEL,... (params x elements)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    import torch
    torch.set_num_threads(1)
    report = {"torch": torch.__version__, "sizes": {}, "bias": None}
    for spec in args.sizes.split(","):
        count, numel = (int(x) for x in spec.split("x"))
        report["sizes"][spec] = sizes(count, numel, args.steps)
    largest = max(int(c) * int(n) for c, n in (s.split("x") for s in args.sizes.split(",")))
    report["bias"] = bias(largest, args.steps)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"torch {report['torch']}, one thread, inductor, median ns per element of {args.steps} steps")
    print(f"{'size':<12}{'torch fp32':>12}{'bf16 grad':>11}{'main_grad':>11}{'ratio bf16':>12}{'ratio main':>12}")
    for spec, r in report["sizes"].items():
        print(f"{spec:<12}{r['torch']:>12.3f}{r['bf16_grad']:>11.3f}{r['main_grad']:>11.3f}"
              f"{r['ratio_bf16_grad']:>12.3f}{r['ratio_main_grad']:>12.3f}")
    b = report["bias"]
    print(f"one Adam update, {largest} elements: bias corrections as step tensors {b['step_tensors']:.3f} ns, "
          f"as Python floats {b['python_floats']:.3f} ns per element")
    return 0


if __name__ == "__main__":
    sys.exit(main())
