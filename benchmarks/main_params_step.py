"""MainParamsOptimizer step time and memory vs torch's AdamW on fp32 params, eager and compiled
(docs/design.md#6-performance-targets, docs/performance.md).

    python benchmarks/main_params_step.py [--json] [--steps N] [--warmup N] [--params N] [--rows N] [--cols N]
                                          [--backend inductor] [--no-compile] [--device cpu|cuda|npu] [--world N]

Two gloo ranks on cpu; on an accelerator (``--device``) one rank per device, at most 2, over the device's backend
(benchmarks/_device.py). Each param is a torch DTensor sharded Shard(0) over both. Per rank it times torch's
``AdamW(foreach=True)`` and ``AdamW(fused=True)`` on fp32 params (the baselines) against MainParamsOptimizer
over ``AdamW(foreach=True)`` on bf16 params (the grad cast, AdamW on the fp32 main params, the copy back), for
both grad sources: bf16 ``grad`` (cast to fp32, what torch FSDP2 hands over) and fp32 ``main_grad``
(hyper-parallel's ``apply_grad_on_fp32_main_grad``, the configuration RFC 001
(docs/hyper_parallel.md#rfc-001-5-config) requires: no cast). Eager steps are stepped round-robin on the same
data so they share noise; then the compiled variants (``torch.compile(step, backend=--backend)``: torch's
foreach AdamW and the two wrapper cases; torch's fused AdamW is not traced by dynamo, its compiled step is its
eager one) are compiled and warmed up in turn (``--warmup`` steps, compilation included) and stepped
round-robin the same way. Times are
the stepping thread's CPU time per rank on cpu (one thread; no collective runs in a step), wall time with the device
synchronised around each step on an accelerator, medians of the timed steps; ratios are
the wrapper against torch's foreach AdamW in the same mode (eager/eager, compiled/compiled; target <= 1.05
for the bf16 grad, <= 1.07 for the fp32 main_grad) and against torch's fused AdamW. Memory is counted from
storages: the bytes of the main params' local storages per low-precision element (target exactly 4) and
per fp32 element (0).
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _rank(rank, world, steps, warmup, params, rows, cols, backend, device="cpu"):
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from benchmarks._device import clock as device_clock
    from benchmarks._device import rank_device, synchronize
    from npu_fsdp_patches.optim import MainParamsOptimizer
    from npu_fsdp_patches.optim.tensors import local_tensor

    where = rank_device(device, rank)
    torch.manual_seed(0)
    mesh = init_device_mesh(device, (world,))

    def model(dtype):
        m = nn.Module()
        for i in range(params):
            w = distribute_tensor(torch.randn(rows, cols).to(where), mesh, [Shard(0)]).to(dtype)
            m.register_parameter(f"w{i}", nn.Parameter(w))
        return m

    def grads(m):
        for p in m.parameters():
            if getattr(m, "main_grad_source", False):
                p.main_grad = torch.randn_like(p, dtype=torch.float32) * 1e-3
            else:
                p.grad = torch.randn_like(p) * 1e-3

    clock = device_clock(device)

    def timed_pair(runs):
        """Median step time of each (model, optimizer), steps interleaved so they share noise."""
        times = [[] for _ in runs]
        for _ in range(warmup + steps):
            for (m, opt), out in zip(runs, times):
                grads(m)
                synchronize(device)
                t0 = clock()
                opt.step()
                synchronize(device)
                out.append(clock() - t0)
                opt.zero_grad()
        return [statistics.median(t[warmup:]) for t in times]

    def timed_compiled(runs):
        """Median compiled step time of each (model, optimizer): each compiled and warmed up in turn
        (compilation in the warm-up), then the timed steps interleaved as in eager."""
        torch._dynamo.reset()
        compiled = [(m, opt, torch.compile(opt.step, backend=backend)) for m, opt in runs]
        for m, opt, step in compiled:
            for _ in range(warmup):
                grads(m)
                step()
                opt.zero_grad()
        times = [[] for _ in runs]
        for _ in range(steps):
            for (m, opt, step), out in zip(compiled, times):
                grads(m)
                synchronize(device)
                t0 = clock()
                step()
                synchronize(device)
                out.append(clock() - t0)
                opt.zero_grad()
        torch._dynamo.reset()
        return [statistics.median(t) for t in times]

    def storage_bytes(tensors):
        seen = {}
        for t in tensors:
            s = local_tensor(t).untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
        return sum(seen.values())

    fp32 = model(torch.float32)
    fp32_fused = model(torch.float32)
    bf16 = model(torch.bfloat16)
    bf16_main_grad = model(torch.bfloat16)
    bf16_main_grad.main_grad_source = True
    torch_foreach = torch.optim.AdamW(fp32.parameters(), lr=1e-3, foreach=True)
    torch_fused = torch.optim.AdamW(fp32_fused.parameters(), lr=1e-3, fused=True)
    wrapped = MainParamsOptimizer(torch.optim.AdamW(bf16.parameters(), lr=1e-3, foreach=True), bf16)
    wrapped_main_grad = MainParamsOptimizer(
        torch.optim.AdamW(bf16_main_grad.parameters(), lr=1e-3, foreach=True), bf16_main_grad)
    base, fused, main, main_fp32_grad = timed_pair(
        [(fp32, torch_foreach), (fp32_fused, torch_fused), (bf16, wrapped), (bf16_main_grad, wrapped_main_grad)])
    out = {"rank": rank, "eager": {"torch_foreach_s": base, "torch_fused_s": fused, "main_params_bf16_s": main,
                                   "main_params_fp32_main_grad_s": main_fp32_grad}}
    if backend:
        c_base, c_main, c_main_fp32_grad = timed_compiled(
            [(fp32, torch_foreach), (bf16, wrapped), (bf16_main_grad, wrapped_main_grad)])
        out["compiled"] = {"torch_foreach_s": c_base, "torch_fused_s": fused, "main_params_bf16_s": c_main,
                           "main_params_fp32_main_grad_s": c_main_fp32_grad}
    for mode in [m for m in ("eager", "compiled") if m in out]:
        t = out[mode]
        t["ratio"] = t["main_params_bf16_s"] / t["torch_foreach_s"]
        t["ratio_fp32_main_grad"] = t["main_params_fp32_main_grad_s"] / t["torch_foreach_s"]
        t["ratio_vs_fused"] = t["main_params_bf16_s"] / t["torch_fused_s"]
        t["ratio_fp32_main_grad_vs_fused"] = t["main_params_fp32_main_grad_s"] / t["torch_fused_s"]
    lp_elements = sum(local_tensor(p).numel() for p in bf16.parameters())
    main_bytes = storage_bytes(p.main_param for p in bf16.parameters())
    fp32_plain = model(torch.float32)
    fp32_before = storage_bytes(fp32_plain.parameters())
    fp32_wrapped = MainParamsOptimizer(torch.optim.AdamW(fp32_plain.parameters()), fp32_plain)
    fp32_after = storage_bytes(list(fp32_plain.parameters()) + [p for g in fp32_wrapped.param_groups
                                                                for p in g["params"]])
    return {**out, "bytes_per_lp_element": main_bytes / lp_elements,
            "extra_bytes_fp32": fp32_after - fp32_before, "local_elements": lp_elements}


def main():
    from benchmarks._device import add_device_arguments, default_world, run_on_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--params", type=int, default=8)
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--cols", type=int, default=512)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--no-compile", action="store_true", help="eager steps only")
    add_device_arguments(parser)
    args = parser.parse_args()
    world = args.world or default_world(args.device)
    results = run_on_ranks("benchmarks.main_params_step:_rank", args.device, world, timeout=1200,
                           args={"steps": args.steps, "warmup": args.warmup, "params": args.params, "rows": args.rows,
                                 "cols": args.cols, "backend": None if args.no_compile else args.backend})
    modes = [m for m in ("eager", "compiled") if m in results[0]]
    summary = {"config": vars(args), "ranks": results, "target_ratio": 1.05, "target_ratio_fp32_main_grad": 1.07,
               "bytes_per_lp_element": results[0]["bytes_per_lp_element"],
               "extra_bytes_fp32": max(r["extra_bytes_fp32"] for r in results)}
    for mode in modes:
        for key in ("ratio", "ratio_fp32_main_grad", "ratio_vs_fused", "ratio_fp32_main_grad_vs_fused"):
            summary[f"{mode}_{key}_max"] = max(r[mode][key] for r in results)
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    timing = "thread CPU time" if args.device == "cpu" else "wall time, device synchronised,"
    print(f"{args.params} params of {args.rows}x{args.cols} (Shard(0) over {world} rank(s) on {args.device}), median "
          f"of {args.steps} steps, {timing} per rank (ms); compiled: backend {args.backend}")
    print(f"{'rank':>4} {'mode':>9} {'AdamW foreach':>14} {'AdamW fused':>12} {'wrapped bf16 grad':>18} "
          f"{'ratio':>6} {'/fused':>7} {'wrapped fp32 main_grad':>23} {'ratio':>6} {'/fused':>7}")
    for r in results:
        for mode in modes:
            t = r[mode]
            print(f"{r['rank']:>4} {mode:>9} {t['torch_foreach_s'] * 1e3:>14.2f} {t['torch_fused_s'] * 1e3:>12.2f} "
                  f"{t['main_params_bf16_s'] * 1e3:>18.2f} {t['ratio']:>6.3f} {t['ratio_vs_fused']:>7.3f} "
                  f"{t['main_params_fp32_main_grad_s'] * 1e3:>23.2f} {t['ratio_fp32_main_grad']:>6.3f} "
                  f"{t['ratio_fp32_main_grad_vs_fused']:>7.3f}")
    print(f"memory: {summary['bytes_per_lp_element']:.2f} B per bf16 element (target 4), "
          f"+{summary['extra_bytes_fp32']} B for fp32 params (target 0)")
    for mode in modes:
        print(f"{mode}: max ratio vs AdamW foreach {mode}: bf16 grad {summary[f'{mode}_ratio_max']:.3f} "
              f"(target <= 1.05), fp32 main_grad {summary[f'{mode}_ratio_fp32_main_grad_max']:.3f} (target <= 1.07)")


if __name__ == "__main__":
    main()
