"""What every example shares: ``--device``, its process-group backend, and a clean exit.

    --device cpu   gloo    (the default; what CI runs)
    --device cuda  nccl
    --device npu   hccl    (imports torch_npu, which registers the npu device and hccl)

Run an example under torchrun; each rank uses the device ``LOCAL_RANK`` names.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=sorted(BACKENDS), default="cpu",
                        help="cpu (gloo), cuda (nccl) or npu (hccl); default cpu")


def init_distributed(device_type: str) -> torch.device:
    """Start the process group with the device's backend; return this rank's device."""
    if device_type == "npu":
        import torch_npu  # noqa: F401  (registers torch.npu and the hccl backend)
    dist.init_process_group(BACKENDS[device_type])
    if device_type == "cpu":
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", "0"))
    if hasattr(torch, "accelerator"):       # torch >= 2.6
        torch.accelerator.set_device_index(index)
    else:
        getattr(torch, device_type).set_device(index)
    return torch.device(device_type, index)


def finish(ok: bool, failure: str) -> None:
    """Leave the process group on every rank and exit 0 when ``ok``, else 1 with ``failure``."""
    dist.barrier()
    dist.destroy_process_group()
    if not ok:
        print(f"FAILED: {failure}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if ok else 1)   # skip interpreter teardown, where gloo threads can abort a finished run
