"""Entry point of one rank started by tests.distributed.run_ranks (not a test module)."""
import datetime
import importlib
import json
import os
import pickle
import sys


def main() -> None:
    import torch.distributed as dist

    from tests.old_torch_cpu import fix_gloo_reduce_scatter_avg

    module_name, func_name = os.environ["TESTS_RANK_TARGET"].split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = os.environ.get("TESTS_RANK_BACKEND", "gloo")
    if backend != "gloo":   # an accelerator benchmark (benchmarks/_device.py): this rank's device first
        import torch
        if backend == "hccl":
            import torch_npu  # noqa: F401  (registers torch.npu)
        module = torch.npu if backend == "hccl" else torch.cuda
        module.set_device(int(os.environ["LOCAL_RANK"]) % module.device_count())
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    if backend == "gloo":
        fix_gloo_reduce_scatter_avg()   # older torch: gloo sums for AVG (see tests/old_torch_cpu.py)
    try:
        result = func(rank, world, **json.loads(os.environ["TESTS_RANK_ARGS"]))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    with open(os.environ["TESTS_RANK_RESULT"], "wb") as fh:
        pickle.dump(result, fh)
    # Skip interpreter teardown: gloo's background threads can abort the process at exit
    # ("terminate called without an active exception") after all work is done and reported.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
