"""What every example shares: ``--device``, its process-group backend, and a clean exit.

    --device cpu   gloo    (the default; what CI runs)
    --device cuda  nccl
    --device npu   hccl    (imports torch_npu, which registers the npu device and hccl)

Run an example under torchrun; each rank uses the device ``LOCAL_RANK`` names. An example that needs
more than torch (numpy for torch.distributed.checkpoint, veomni, TransformerEngine, torch_npu for
``--device npu``, a GPU for ``--device cuda``) checks it first and, when it is missing, exits 2 at once
with one line saying what it needs.
"""
from __future__ import annotations

import argparse
import atexit
import importlib
import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=sorted(BACKENDS), default="cpu",
                        help="cpu (gloo), cuda (nccl) or npu (hccl); default cpu")


def require(example: str, module: str, why: str, install: str) -> None:
    """Stop with exit code 2 and one line saying what to install (``install``) when ``module`` cannot be
    imported (printed by rank 0 only; every rank exits)."""
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - a broken install raises more than ImportError
        if os.environ.get("RANK", "0") == "0":
            print(f"{example} needs {module} ({why}): {install}. Importing it failed: "
                  f"{type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(2)


def require_numpy(example: str) -> None:
    """numpy, which torch's CPU wheel does not install: torch.distributed.checkpoint and the object
    collectives call ``Tensor.numpy()``."""
    require(example, "numpy", "torch.distributed.checkpoint calls Tensor.numpy()",
            "`pip install numpy`")


def require_device(device_type: str) -> None:
    """Stop with exit code 2 and one line when ``--device`` names a device this machine lacks: npu needs
    torch_npu (with CANN's environment sourced), cuda a CUDA build of torch that sees a GPU."""
    example = os.path.basename(sys.argv[0])
    if device_type == "npu":
        require(example, "torch_npu", "--device npu: it registers the npu device and hccl",
                "install torch_npu and source CANN's set_env.sh, or run with --device cpu")
    elif device_type == "cuda" and not torch.cuda.is_available():
        if os.environ.get("RANK", "0") == "0":
            print(f"{example} --device cuda needs a CUDA build of torch that sees a GPU (torch "
                  f"{torch.__version__}: torch.cuda.is_available() is False); run with --device cpu",
                  file=sys.stderr)
        sys.exit(2)


def init_distributed(device_type: str) -> torch.device:
    """Start the process group with the device's backend; return this rank's device."""
    require_device(device_type)
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


#: checkpoint folders this run made for itself, removed when it ends (a folder the user named is kept)
_SCRATCH: list = []


def _remove_scratch() -> None:
    while _SCRATCH:
        shutil.rmtree(_SCRATCH.pop(), ignore_errors=True)


def checkpoint_dir(given: str | None, example: str) -> str:
    """Where the example saves: ``given`` (``--ckpt``, kept), else a folder in the temp directory named
    after the example and torchrun's agent (the parent of every rank, so all ranks agree), which rank 0
    removes when the run ends, passed or failed: examples leave nothing behind."""
    if given:
        return given
    path = os.path.join(tempfile.gettempdir(), f"{example}_{os.getppid()}")
    if not _SCRATCH and int(os.environ.get("RANK", "0")) == 0:
        atexit.register(_remove_scratch)    # an example that raises ends through the interpreter's exit
    _SCRATCH.append(path)
    return path


def finish(ok: bool, failure: str) -> None:
    """Leave the process group on every rank and exit 0 when ``ok``, else 1 with ``failure``; rank 0
    removes the example's own checkpoint folder once every rank is done with it."""
    dist.barrier()
    if dist.get_rank() == 0:
        _remove_scratch()
    dist.destroy_process_group()
    if not ok:
        print(f"FAILED: {failure}", file=sys.stderr)
    atexit._run_exitfuncs()   # as a normal exit does first: torch <= 2.9 removes a temp folder in one
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if ok else 1)   # skip interpreter teardown, where gloo threads can abort a finished run
