"""``self-test`` options, and turning them into a run plan (bad options: exit 2 with a clear reason).

The parser part imports no torch; :func:`resolve` imports torch (and torch_npu when installed) to see
which device is here and how many of it.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
from dataclasses import asdict, dataclass, field

from .checks import CHECKS

EXIT_BAD_OPTIONS = 2
DEVICES = ("npu", "cuda", "cpu")
BACKEND_OF = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}
CPU_RANKS = 2
DEFAULT_TIMEOUT_S = 900.0


class OptionError(ValueError):
    """A bad option; the message names it and says why."""


@dataclass
class Plan:
    """What every rank runs; written as JSON for launched ranks."""

    device: str
    backend: str
    nproc_per_node: int
    checks: list
    skipped: dict = field(default_factory=dict)
    timeout: float = DEFAULT_TIMEOUT_S
    workdir: str = ""
    status_dir: str = ""
    in_job: bool = False

    def as_dict(self) -> dict:
        return asdict(self)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc-per-node", type=int, default=None,
                        help="ranks to launch on this node (default: the device count; 2 on cpu)")
    parser.add_argument("--device", choices=DEVICES, default=None,
                        help="device to test (default: the detected accelerator, else cpu)")
    parser.add_argument("--backend", choices=sorted(set(BACKEND_OF.values())), default=None,
                        help="torch.distributed backend (default: hccl on npu, nccl on cuda, gloo on cpu)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (schema npu-fsdp-patches/self-test) instead of text")
    parser.add_argument("--only", default=None, metavar="NAME,...",
                        help=f"run only these checks: {', '.join(CHECKS)}")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                        help="seconds for the whole run; ranks still running then are reported and killed")
    parser.add_argument("--workdir", default=None,
                        help="folder for the checkpoints the checks write (default: a temporary one); "
                             "on several nodes a folder all nodes share")


def in_job() -> bool:
    """True inside torchrun (RANK/WORLD_SIZE) or an srun step (SLURM_PROCID/SLURM_NTASKS)."""
    env = os.environ
    return ("RANK" in env and "WORLD_SIZE" in env) or ("SLURM_PROCID" in env and "SLURM_NTASKS" in env
                                                       and "SLURM_STEP_ID" in env)


def _select(only: str | None) -> list:
    if only is None:
        return list(CHECKS)
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in CHECKS]
    if unknown or not names:
        raise OptionError(f"--only {only!r}: unknown check(s) {', '.join(unknown) or '(none given)'}; "
                          f"known: {', '.join(CHECKS)}")
    return [n for n in CHECKS if n in names]


def _device_count(torch, device: str) -> int:
    """How many ``device`` devices this process sees (0: none); imports torch_npu for npu."""
    if device == "cpu":
        return 0
    if device == "npu" and importlib.util.find_spec("torch_npu") is not None:
        try:
            import torch_npu  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
        except Exception:  # noqa: BLE001 - torch_npu without CANN raises more than ImportError
            return 0
    module = getattr(torch, device, None)
    try:
        return int(module.device_count()) if module is not None and module.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken driver counts as no device
        return 0


def detect_device(torch) -> str:
    """The accelerator torch reports (torch.accelerator, torch>=2.6), else npu/cuda if present, else cpu."""
    accelerator = getattr(torch, "accelerator", None)
    if importlib.util.find_spec("torch_npu") is not None and _device_count(torch, "npu"):
        return "npu"
    if accelerator is not None and accelerator.is_available():
        kind = accelerator.current_accelerator().type
        if kind in DEVICES:
            return kind
    return "cuda" if _device_count(torch, "cuda") else "cpu"


def resolve(args: argparse.Namespace, decisions: dict) -> Plan:
    """The plan for these options; raises :class:`OptionError` for a device, backend or N that cannot run."""
    import torch  # pylint: disable=import-outside-toplevel

    from .checks import why_not  # pylint: disable=import-outside-toplevel

    wanted = _select(args.only)
    device = args.device or detect_device(torch)
    count = _device_count(torch, device)
    if device != "cpu" and count == 0:
        raise OptionError(f"--device {device}: no {device} device is visible to this process "
                          f"(torch.{device}.is_available() is false{_npu_hint(device)})")
    backend = args.backend or BACKEND_OF[device]
    if backend != BACKEND_OF[device]:
        raise OptionError(f"--backend {backend} cannot run FSDP2 collectives on {device} tensors; "
                          f"use --backend {BACKEND_OF[device]} (or a --device that {backend} serves: "
                          f"{', '.join(d for d, b in BACKEND_OF.items() if b == backend)})")
    job = in_job()
    if job and args.nproc_per_node is not None:
        raise OptionError("--nproc-per-node: inside a torchrun job or srun step the job's own ranks run "
                          "the checks; drop the option")
    nproc = args.nproc_per_node if args.nproc_per_node is not None else (count or CPU_RANKS)
    if nproc < 1:
        raise OptionError(f"--nproc-per-node {nproc}: need at least 1 rank")
    if device != "cpu" and nproc > count and not job:
        raise OptionError(f"--nproc-per-node {nproc}: only {count} {device} device(s) visible on this node")
    if args.workdir and not os.path.isdir(args.workdir):
        raise OptionError(f"--workdir {args.workdir}: not an existing folder")
    if args.timeout <= 0:
        raise OptionError(f"--timeout {args.timeout}: need a positive number of seconds")
    skipped = {name: why_not(name, decisions) for name in wanted}
    return Plan(device=device, backend=backend, nproc_per_node=nproc, timeout=args.timeout,
                checks=[n for n in wanted if skipped[n] is None],
                skipped={n: why for n, why in skipped.items() if why is not None},
                workdir=args.workdir or "", in_job=job)


def _npu_hint(device: str) -> str:
    if device != "npu":
        return ""
    if importlib.util.find_spec("torch_npu") is None:
        return "; torch_npu is not installed"
    return "; check that CANN's set_env.sh was sourced and ASCEND_RT_VISIBLE_DEVICES"
