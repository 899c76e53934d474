"""torch's distributed state-dict API on a MainParamsOptimizer vs on the plain leaf optimizer
(issue 19; docs/main_params.md).

    python benchmarks/main_params_state_dict.py [--json] [--reps N] [--params N] [--rows N] [--cols N]

Two gloo ranks; a bf16 model of ``--params`` torch DTensors of rows x cols, sharded Shard(0) over
both. Per rank it times ``get_optimizer_state_dict`` + ``set_optimizer_state_dict`` (the in-memory
round trip a checkpointer does around ``dcp.save``/``dcp.load``) on ``torch.optim.AdamW`` over the
bf16 model (the baseline) against MainParamsOptimizer over the same AdamW on an identical model,
each after one step, interleaved, and reports the median ratio (target <= 1.5).
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _rank(rank, world, reps, params, rows, cols):
    import torch
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from npu_fsdp_patches.optim import MainParamsOptimizer

    mesh = init_device_mesh("cpu", (world,))

    def built(wrap):
        torch.manual_seed(0)
        model = nn.Module()
        for i in range(params):
            w = distribute_tensor(torch.randn(rows, cols), mesh, [Shard(0)]).to(torch.bfloat16)
            model.register_parameter(f"w{i}", nn.Parameter(w))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        opt = MainParamsOptimizer(opt, model) if wrap else opt
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        opt.step()
        opt.zero_grad()
        return model, opt

    runs = [built(False), built(True)]
    times = [[] for _ in runs]
    for _ in range(reps):
        for (model, opt), out in zip(runs, times):
            t0 = time.perf_counter()
            osd = get_optimizer_state_dict(model, opt)
            set_optimizer_state_dict(model, opt, osd)
            out.append(time.perf_counter() - t0)
    plain, wrapped = (statistics.median(t[1:] if reps > 2 else t) for t in times)
    return {"rank": rank, "plain_adamw_s": plain, "main_params_s": wrapped, "ratio": wrapped / plain}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--params", type=int, default=64)
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--cols", type=int, default=256)
    args = parser.parse_args()
    from tests.distributed import run_ranks
    results = run_ranks("benchmarks.main_params_state_dict:_rank", world_size=2, timeout=600,
                        args={"reps": args.reps, "params": args.params, "rows": args.rows,
                              "cols": args.cols})
    summary = {"config": vars(args), "ranks": results, "ratio_max": max(r["ratio"] for r in results),
               "target_ratio": 1.5}
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(f"{args.params} bf16 params of {args.rows}x{args.cols} (Shard(0) over 2 gloo ranks), "
          f"get_optimizer_state_dict + set_optimizer_state_dict, median of {args.reps}")
    print(f"{'rank':>4} {'AdamW':>10} {'MainParamsOptimizer(AdamW)':>27} {'ratio':>6}")
    for r in results:
        print(f"{r['rank']:>4} {r['plain_adamw_s'] * 1e3:>8.2f}ms {r['main_params_s'] * 1e3:>25.2f}ms "
              f"{r['ratio']:>6.3f}")
    print(f"max ratio {summary['ratio_max']:.3f} (target <= 1.5)")


if __name__ == "__main__":
    main()
