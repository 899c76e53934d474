"""Per-step overhead of ``foreach_adamw_step`` on DTensors vs ``AdamW(foreach=True)`` on plain tensors, in one process.

    python benchmarks/foreach_adamw_overhead.py [--json] [--repeats N] [--device cpu|cuda|npu]

One process (world size 1: gloo and one thread on cpu, the device's backend on an accelerator), so no
barrier or cross-rank max adds noise; the variants are stepped interleaved and timed in the stepping
thread's CPU time on cpu, which a loaded machine disturbs less than wall time, and in wall time with the device
synchronised around each step on an accelerator (benchmarks/_device.py).
Per shape (4 x 1M and 400 x 10k bf16 elements) it prints the medians of
  torch_plain     AdamW(foreach=True).step() on plain tensors
  ours_dtensor    foreach_adamw_step on the same values as Shard(0) torch DTensors
  ours_plain      foreach_adamw_step on plain tensors
and ours/torch_plain; the target is <= 1.05 (docs/design.md#6-performance-targets).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._device import add_device_arguments  # noqa: E402

SHAPES = {"4x1M": (4, 1_000_000), "400x10k": (400, 10_000)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(repeats: int, warmup: int = 3, device: str = "cpu") -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from benchmarks._device import BACKENDS, clock, rank_device, synchronize
    from npu_fsdp_patches.optim import foreach_adamw_step

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    where = rank_device(device, 0)
    dist.init_process_group(BACKENDS[device], rank=0, world_size=1)
    mesh = init_device_mesh(device, (1,))
    now = clock(device)
    results = {}
    try:
        for label, (count, numel) in SHAPES.items():
            gen = torch.Generator().manual_seed(0)
            values = [torch.randn(numel, generator=gen).to(where, torch.bfloat16) for _ in range(count)]
            grads = [torch.randn(numel, generator=gen).to(where, torch.bfloat16) * 1e-3 for _ in range(count)]

            def adamw(dtensor: bool) -> torch.optim.AdamW:
                wrap = (lambda t: DTensor.from_local(t.clone(), mesh, [Shard(0)])) if dtensor else torch.clone
                params = [torch.nn.Parameter(wrap(v)) for v in values]
                for p, g in zip(params, grads):
                    p.grad = wrap(g)
                return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, foreach=True)

            opts = {"torch_plain": adamw(False), "ours_dtensor": adamw(True), "ours_plain": adamw(False)}
            steps = {name: (opt.step if name.startswith("torch") else (lambda o=opt: foreach_adamw_step(o)))
                     for name, opt in opts.items()}
            times = {name: [] for name in steps}
            for i in range(warmup + repeats):
                for name, step in steps.items():
                    synchronize(device)
                    start = now()
                    step()
                    synchronize(device)
                    if i >= warmup:
                        times[name].append(now() - start)
            results[label] = {name: statistics.median(t) for name, t in times.items()}
    finally:
        dist.destroy_process_group()
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--repeats", type=int, default=30)
    add_device_arguments(parser, ranks=False)
    args = parser.parse_args(argv)
    medians = measure(args.repeats, device=args.device)
    ratios = {label: {"ours_dtensor/torch_plain": m["ours_dtensor"] / m["torch_plain"],
                      "ours_plain/torch_plain": m["ours_plain"] / m["torch_plain"]} for label, m in medians.items()}
    if args.json:
        print(json.dumps({"device": args.device, "repeats": args.repeats, "median_s": medians, "ratios": ratios}, indent=2))
        return 0
    timing = "CPU time" if args.device == "cpu" else "wall time"
    print(f"foreach_adamw_step overhead: bf16, 1 process on {args.device}, median {timing} of {args.repeats} steps (ms)")
    print(f"{'shape':<9}{'torch_plain':>13}{'ours_dtensor':>14}{'ours_plain':>12}{'ours_DT/torch':>15}{'ours/torch':>12}")
    for label, m in medians.items():
        r = ratios[label]
        print(f"{label:<9}{m['torch_plain'] * 1e3:>13.2f}{m['ours_dtensor'] * 1e3:>14.2f}{m['ours_plain'] * 1e3:>12.2f}"
              f"{r['ours_dtensor/torch_plain']:>15.3f}{r['ours_plain/torch_plain']:>12.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
