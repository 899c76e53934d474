"""Step time of ``foreach_adamw_step`` vs ``torch.optim.AdamW(foreach=True)`` (docs/design.md#6-performance-targets).

    python benchmarks/foreach_adamw_step.py [--json] [--repeats N] [--dtype bf16|fp32]
                                            [--device cpu|cuda|npu] [--world N]

2 gloo ranks on cpu; on an accelerator (``--device``) one rank per device, at most 2, over the device's
backend, the device synchronised around each step (benchmarks/_device.py). Per rank: 4 x 1M and 400 x 10k elements. Four variants, timed round-robin so they
share the same machine noise; medians of per-step wall time (max over ranks of each step):
  torch_plain     AdamW(foreach=True).step() on plain local tensors
  ours_plain      foreach_adamw_step on the same plain local tensors
  torch_dtensor   AdamW(foreach=True).step() on torch DTensors (Shard(0) over the 2 ranks)
  ours_dtensor    foreach_adamw_step on the same DTensors (runs on their local shards)
Targets: ours_plain / torch_plain <= 1.05; ours_dtensor / torch_dtensor < 1.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SHAPES = {"4x1M": (4, 1_000_000), "400x10k": (400, 10_000)}
VARIANTS = ("torch_plain", "ours_plain", "torch_dtensor", "ours_dtensor")


def bench_rank(rank: int, world: int, repeats: int = 20, warmup: int = 3, dtype: str = "bf16",
               device: str = "cpu") -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from benchmarks._device import rank_device, synchronize
    from npu_fsdp_patches.optim import foreach_adamw_step

    where = rank_device(device, rank)
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    mesh = init_device_mesh(device, (world,))
    results = {}
    for label, (count, numel) in SHAPES.items():
        gen = torch.Generator().manual_seed(rank)
        locals_ = [torch.randn(numel, generator=gen).to(where, torch_dtype) for _ in range(count)]
        grads = [(torch.randn(numel, generator=gen) * 1e-3).to(where, torch_dtype) for _ in range(count)]
        setups = {}
        for variant in VARIANTS:
            if variant.endswith("plain"):
                params = [t.clone().requires_grad_() for t in locals_]
                for p, g in zip(params, grads):
                    p.grad = g.clone()
            else:
                params = [torch.nn.Parameter(DTensor.from_local(t.clone(), mesh, [Shard(0)])) for t in locals_]
                for p, g in zip(params, grads):
                    p.grad = DTensor.from_local(g.clone(), mesh, [Shard(0)])
            opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, foreach=True)
            step = (lambda o=opt: o.step()) if variant.startswith("torch") else (lambda o=opt: foreach_adamw_step(o))
            setups[variant] = step
        times = {v: [] for v in VARIANTS}
        for i in range(warmup + repeats):
            for variant in VARIANTS:
                synchronize(device)
                dist.barrier()
                start = time.perf_counter()
                setups[variant]()
                synchronize(device)
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=where)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if i >= warmup:
                    times[variant].append(float(elapsed))
        results[label] = {v: statistics.median(t) for v, t in times.items()}
    return results


def main(argv=None) -> int:
    sys.path.insert(0, str(REPO_ROOT))
    from benchmarks._device import add_device_arguments, default_world, run_on_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print machine-readable results")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    add_device_arguments(parser)
    args = parser.parse_args(argv)

    world = args.world or default_world(args.device)
    ranks = run_on_ranks("benchmarks.foreach_adamw_step:bench_rank", args.device, world,
                         {"repeats": args.repeats, "dtype": args.dtype}, timeout=900)
    medians = ranks[0]  # identical on every rank (max over ranks per step)
    report = {"device": args.device, "dtype": args.dtype, "ranks": world, "repeats": args.repeats, "median_step_s": medians,
              "ratios": {label: {"ours_plain/torch_plain": m["ours_plain"] / m["torch_plain"],
                                 "ours_dtensor/torch_dtensor": m["ours_dtensor"] / m["torch_dtensor"],
                                 "ours_dtensor/torch_plain": m["ours_dtensor"] / m["torch_plain"]}
                         for label, m in medians.items()}}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"foreach_adamw_step benchmark: {args.dtype}, {world} rank(s) on {args.device}, median of {args.repeats} steps (ms)")
    print(f"{'shards/rank':<12}" + "".join(f"{v:>15}" for v in VARIANTS)
          + f"{'ours/torch plain':>18}{'ours/torch DT':>15}")
    for label, m in medians.items():
        r = report["ratios"][label]
        print(f"{label:<12}" + "".join(f"{m[v] * 1e3:>15.2f}" for v in VARIANTS)
              + f"{r['ours_plain/torch_plain']:>18.3f}{r['ours_dtensor/torch_dtensor']:>15.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
