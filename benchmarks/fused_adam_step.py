"""FusedAdam step time on DTensor shards vs torch AdamW(fused=True) (docs/design.md#6-performance-targets), 2
ranks.

    python benchmarks/fused_adam_step.py [--json] [--repeats N] [--device cpu|cuda|npu] [--world N]

On cpu: 2 gloo ranks, wall time. On an accelerator (``--device``): one rank per device, at most 2, over
the device's backend, wall time with the device synchronised around each step (benchmarks/_device.py).

For each shard shape (4 x 1M and 400 x 10k fp32 elements per rank) it times, on the same data:
  ours_dtensor   npu_fsdp_patches.optim.FusedAdam on DTensor params (Shard(0))
  torch_dtensor  torch.optim.AdamW(fused=True) on the same DTensor params
  torch_local    torch.optim.AdamW(fused=True) on plain local tensors of the shard size
and reports medians (max over ranks of each step) and the ratios
  ours_dtensor / torch_local (target <= 1.10) and ours_dtensor / torch_dtensor (target < 1).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

SHAPES = {"4x1M": (4, 1_000_000), "400x10k": (400, 10_000)}


def rank_main(rank: int, world: int, repeats: int = 30, warmup: int = 5, device: str = "cpu"):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from benchmarks._device import rank_device, synchronize
    from npu_fsdp_patches.optim import FusedAdam

    where = rank_device(device, rank)
    mesh = init_device_mesh(device, (world,))
    out = {}
    for label, (count, numel) in SHAPES.items():
        gen = torch.Generator().manual_seed(rank)
        locals_ = [torch.randn(numel, generator=gen).to(where) for _ in range(count)]
        grads = [(torch.randn(numel, generator=gen) * 1e-2).to(where) for _ in range(count)]

        def dtensors():
            ps = [torch.nn.Parameter(DTensor.from_local(t.clone(), mesh, [Shard(0)],
                                                        run_check=False)) for t in locals_]
            for p, g in zip(ps, grads):
                p.grad = DTensor.from_local(g, mesh, [Shard(0)], run_check=False)
            return ps

        def plain():
            ps = [torch.nn.Parameter(t.clone()) for t in locals_]
            for p, g in zip(ps, grads):
                p.grad = g
            return ps

        variants = {
            "ours_dtensor": lambda: FusedAdam(dtensors(), lr=1e-3, weight_decay=0.01),
            "torch_dtensor": lambda: torch.optim.AdamW(dtensors(), lr=1e-3, weight_decay=0.01,
                                                       fused=True),
            "torch_local": lambda: torch.optim.AdamW(plain(), lr=1e-3, weight_decay=0.01,
                                                     fused=True),
        }
        opts = {name: make() for name, make in variants.items()}
        times = {name: [] for name in opts}
        for i in range(warmup + repeats):
            for name, opt in opts.items():  # interleaved, so drift hits every variant alike
                synchronize(device)
                dist.barrier()
                t0 = time.perf_counter()
                opt.step()
                synchronize(device)
                dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=where)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                if i >= warmup:
                    times[name].append(dt.item())
        out[label] = {name: statistics.median(ts) for name, ts in times.items()}
    return out


def main(argv=None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks._device import add_device_arguments, default_world, run_on_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--repeats", type=int, default=30)
    add_device_arguments(parser)
    args = parser.parse_args(argv)
    world = args.world or default_world(args.device)
    res = run_on_ranks("benchmarks.fused_adam_step:rank_main", args.device, world, {"repeats": args.repeats},
                       timeout=600, env={"TORCH_DEVICE_BACKEND_AUTOLOAD":
                                         os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1")})[0]
    report = {"device": args.device, "world_size": world, "threads_per_rank": 1, "median_step_s": res, "ratios": {
        label: {"ours_dtensor/torch_local": r["ours_dtensor"] / r["torch_local"],
                "ours_dtensor/torch_dtensor": r["ours_dtensor"] / r["torch_dtensor"]}
        for label, r in res.items()}}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"FusedAdam step on {args.device}, {world} rank(s), median of {args.repeats} steps, max over ranks")
    print(f"{'shape':<9} {'ours_dtensor':>13} {'torch_dtensor':>14} {'torch_local':>12} "
          f"{'ours/local':>11} {'ours/torch_dt':>14}")
    for label, r in res.items():
        q = report["ratios"][label]
        print(f"{label:<9} {r['ours_dtensor'] * 1e3:>11.2f}ms {r['torch_dtensor'] * 1e3:>12.2f}ms "
              f"{r['torch_local'] * 1e3:>10.2f}ms {q['ours_dtensor/torch_local']:>10.3f}x "
              f"{q['ours_dtensor/torch_dtensor']:>13.3f}x")
    print("targets: ours/local <= 1.10x, ours/torch_dt < 1.00x (docs/design.md#6-performance-targets)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
