"""Where a benchmark runs: the device, its process-group backend, its clock and its rank launcher.

Every step benchmark takes ``--device cpu|cuda|npu`` (benchmarks/device_run.sh passes the device it was
given). On cpu a step is timed in the CPU time of the thread that steps, with one thread, so torch computes
in it (a loaded machine disturbs it far less than wall time, and background threads, gloo's and inductor's
compile workers, are left out), and ranks talk over gloo. On an accelerator a step is timed in wall time
with the device synchronised before and after it, each rank drives the device of its local rank, and
ranks talk over the device's own backend (nccl, hccl). torch_npu is imported only for ``npu``.
"""
from __future__ import annotations

import time
from typing import Any, Callable

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


def device_module(device: str) -> Any:
    """``torch.cuda``, ``torch.npu`` (after importing torch_npu), or ``torch.cpu``."""
    import torch
    if device == "npu":
        import torch_npu  # noqa: F401  (registers the npu device)
    return getattr(torch, device)


def synchronize(device: str) -> None:
    """Wait for the device's queued work (nothing to wait for on cpu)."""
    if device != "cpu":
        device_module(device).synchronize()


def clock(device: str) -> Callable[[], float]:
    """The calling thread's CPU time on cpu, wall time elsewhere (callers synchronise around what they time)."""
    return time.thread_time if device == "cpu" else time.perf_counter


def default_world(device: str) -> int:
    """2 ranks on cpu; on an accelerator one per device, at most 2 (1 where only one is visible)."""
    if device == "cpu":
        return 2
    return max(1, min(2, device_module(device).device_count()))


def rank_device(device: str, rank: int) -> Any:
    """The ``torch.device`` this rank steps on (an accelerator rank takes the device of its rank), one
    thread on cpu."""
    import torch
    if device == "cpu":
        torch.set_num_threads(1)
        return torch.device("cpu")
    module = device_module(device)
    index = rank % module.device_count()
    module.set_device(index)
    return torch.device(device, index)


def add_device_arguments(parser: Any, ranks: bool = True) -> None:
    """``--device`` (and, for a script that launches ranks, ``--world``) on a benchmark's parser."""
    parser.add_argument("--device", default="cpu", choices=tuple(BACKENDS))
    if ranks:
        parser.add_argument("--world", type=int, default=None,
                            help="ranks (default: 2 on cpu, one per device up to 2)")


def run_on_ranks(target: str, device: str, world: int, args: dict, timeout: float, env: dict | None = None) -> list:
    """``target(rank, world, device=device, **args)`` on ``world`` ranks over the device's backend."""
    from tests.distributed import run_ranks
    return run_ranks(target, world, args={**args, "device": device}, timeout=timeout, env=env,
                     backend=BACKENDS[device])
