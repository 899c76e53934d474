"""MainParamsOptimizer step time and memory vs the leaf optimizer on fp32 params
(docs/design.md#6-performance-targets).

    python benchmarks/main_params_step.py [--json] [--steps N] [--params N] [--rows N] [--cols N]

Two gloo ranks; each param is a torch DTensor sharded Shard(0) over both. Per rank it times
``torch.optim.AdamW(foreach=True)`` on fp32 params (the baseline) against MainParamsOptimizer over the same
AdamW on bf16 params (prepare_grads + AdamW on fp32 main params + copy back), and reports the median step
ratio (target <= 1.25) for both grad sources: bf16 ``grad`` (cast to fp32 in prepare_grads, what torch FSDP2
hands over) and fp32 ``main_grad`` (hyper-parallel's ``apply_grad_on_fp32_main_grad``, the configuration RFC
001 (docs/hyper_parallel.md#rfc-001-5-config) requires: no cast). Memory is counted from storages: the bytes
of the main params' local storages per low-precision element (target exactly 4) and per fp32 element (0).
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _rank(rank, world, steps, params, rows, cols):
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from npu_fsdp_patches.optim import MainParamsOptimizer
    from npu_fsdp_patches.optim.tensors import local_tensor

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))

    def model(dtype):
        m = nn.Module()
        for i in range(params):
            w = distribute_tensor(torch.randn(rows, cols), mesh, [Shard(0)]).to(dtype)
            m.register_parameter(f"w{i}", nn.Parameter(w))
        return m

    def grads(m):
        for p in m.parameters():
            if getattr(m, "main_grad_source", False):
                p.main_grad = torch.randn_like(p, dtype=torch.float32) * 1e-3
            else:
                p.grad = torch.randn_like(p) * 1e-3

    def timed_pair(runs):
        """Median step time of each (model, optimizer), steps interleaved so they share noise."""
        times = [[] for _ in runs]
        for _ in range(steps):
            for (m, opt), out in zip(runs, times):
                grads(m)
                t0 = time.perf_counter()
                opt.step()
                out.append(time.perf_counter() - t0)
                opt.zero_grad()
        return [statistics.median(t[2:] if steps > 4 else t) for t in times]

    def storage_bytes(tensors):
        seen = {}
        for t in tensors:
            s = local_tensor(t).untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
        return sum(seen.values())

    fp32 = model(torch.float32)
    bf16 = model(torch.bfloat16)
    bf16_main_grad = model(torch.bfloat16)
    bf16_main_grad.main_grad_source = True
    wrapped = MainParamsOptimizer(torch.optim.AdamW(bf16.parameters(), lr=1e-3, foreach=True), bf16)
    wrapped_main_grad = MainParamsOptimizer(
        torch.optim.AdamW(bf16_main_grad.parameters(), lr=1e-3, foreach=True), bf16_main_grad)
    base, main, main_fp32_grad = timed_pair(
        [(fp32, torch.optim.AdamW(fp32.parameters(), lr=1e-3, foreach=True)),
         (bf16, wrapped), (bf16_main_grad, wrapped_main_grad)])
    lp_elements = sum(local_tensor(p).numel() for p in bf16.parameters())
    main_bytes = storage_bytes(p.main_param for p in bf16.parameters())
    fp32_before = storage_bytes(fp32.parameters())
    fp32_wrapped = MainParamsOptimizer(torch.optim.AdamW(fp32.parameters()), fp32)
    fp32_after = storage_bytes(list(fp32.parameters()) + [p for g in fp32_wrapped.param_groups
                                                          for p in g["params"]])
    return {"rank": rank, "baseline_fp32_adamw_s": base, "main_params_bf16_s": main,
            "main_params_bf16_fp32_main_grad_s": main_fp32_grad,
            "ratio": main / base, "ratio_fp32_main_grad": main_fp32_grad / base, "bytes_per_lp_element": main_bytes / lp_elements,
            "extra_bytes_fp32": fp32_after - fp32_before, "local_elements": lp_elements}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--params", type=int, default=8)
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--cols", type=int, default=512)
    args = parser.parse_args()
    from tests.distributed import run_ranks
    results = run_ranks("benchmarks.main_params_step:_rank", world_size=2, timeout=600,
                        args={"steps": args.steps, "params": args.params, "rows": args.rows,
                              "cols": args.cols})
    summary = {"config": vars(args), "ranks": results,
               "ratio_max": max(r["ratio"] for r in results),
               "ratio_fp32_main_grad_max": max(r["ratio_fp32_main_grad"] for r in results),
               "target_ratio": 1.25,
               "bytes_per_lp_element": results[0]["bytes_per_lp_element"],
               "extra_bytes_fp32": max(r["extra_bytes_fp32"] for r in results)}
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(f"{args.params} params of {args.rows}x{args.cols} (Shard(0) over 2 gloo ranks), median of {args.steps} steps")
    print(f"{'rank':>4} {'AdamW fp32':>11} {'wrapped, bf16 grad':>19} {'ratio':>6} "
          f"{'wrapped, fp32 main_grad':>24} {'ratio':>6} {'B/lp elem':>10} {'+B fp32':>8}")
    for r in results:
        print(f"{r['rank']:>4} {r['baseline_fp32_adamw_s'] * 1e3:>9.2f}ms {r['main_params_bf16_s'] * 1e3:>17.2f}ms "
              f"{r['ratio']:>6.3f} {r['main_params_bf16_fp32_main_grad_s'] * 1e3:>22.2f}ms "
              f"{r['ratio_fp32_main_grad']:>6.3f} {r['bytes_per_lp_element']:>10.2f} {r['extra_bytes_fp32']:>8}")
    print(f"max ratio: bf16 grad {summary['ratio_max']:.3f}, fp32 main_grad "
          f"{summary['ratio_fp32_main_grad_max']:.3f} (target <= 1.25)")


if __name__ == "__main__":
    main()
