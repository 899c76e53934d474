"""``self-test`` options, and turning them into a run plan (bad options: exit 2 with a clear reason).

The parser part imports no torch; :func:`resolve` imports torch (and torch_npu when installed) to see
which device is here and how many of it.
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
from dataclasses import asdict, dataclass, field

from .checks import CHECKS

EXIT_BAD_OPTIONS = 2
DEVICES = ("npu", "cuda", "cpu")
BACKEND_OF = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}
CPU_RANKS = 2
DEFAULT_TIMEOUT_S = 900.0
#: longer than any sane self-test; more is a typo (and overflows torch's timedelta at inf)
MAX_TIMEOUT_S = 86400.0
#: set by torchrun (torch.distributed.run) for every rank it starts; RANK/WORLD_SIZE without them
#: come from a pod's job controller (Kubeflow PyTorchJob, Volcano), not from a launcher
LAUNCHER_VARS = ("TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE", "GROUP_RANK")
#: the rendezvous variables a pod's job controller sets; cleared for the ranks this command launches
POD_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


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
    #: the launcher's run marker (in every rank's environment and in rank 0's workdir name)
    run_id: str = ""

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
                        help="seconds for the whole run, at most 86400; ranks still running then are reported and "
                             "killed, and the command exits 124")
    parser.add_argument("--workdir", default=None,
                        help="folder for the checkpoints the checks write (default: a temporary one); "
                             "on several nodes a folder all nodes share")


def job_kind(env=None) -> str | None:
    """"torchrun" (a launcher's rank), "srun" (a Slurm step), "pod" (RANK/WORLD_SIZE set with no
    launcher: a job controller's variables) or None (a plain shell)."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env and any(v in env for v in LAUNCHER_VARS):
        return "torchrun"
    if all(v in env for v in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_ID")):
        return "srun"
    if "RANK" in env or "WORLD_SIZE" in env:
        return "pod"
    return None


def in_job() -> bool:
    """True inside torchrun or an srun step: the job's own ranks run the checks."""
    return job_kind() in ("torchrun", "srun")


def job_env() -> dict:
    """rank, world_size, local_rank and the rendezvous address from torchrun's or Slurm's env vars."""
    env = os.environ
    if job_kind() == "torchrun":
        rank, world, local = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
    else:
        rank, world, local = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0))
    addr = env.get("MASTER_ADDR") or env.get("SLURM_LAUNCH_NODE_IPADDR")
    if not addr:
        raise OptionError("MASTER_ADDR is not set: export MASTER_ADDR (the first node's address) "
                          "and MASTER_PORT before srun")
    return {"rank": rank, "world_size": world, "local_rank": local, "master_addr": addr,
            "master_port": env.get("MASTER_PORT", "29500")}


def pod_error() -> str:
    """Why a pod's variables without a launcher cannot run the checks, and the two ways out."""
    named = ", ".join(f"{v}={os.environ[v]}" for v in POD_VARS if v in os.environ)
    return (f"{named} set, but no launcher started this process (none of {', '.join(LAUNCHER_VARS)}): "
            "run it under torchrun on every node (torchrun --nnodes $WORLD_SIZE --node-rank $RANK "
            "--master-addr $MASTER_ADDR --nproc-per-node N -m npu_fsdp_patches self-test), or pass "
            "--nproc-per-node N to test this node's devices alone")


def max_cpu_ranks() -> int:
    """The most cpu ranks one self-test launches: ``--nproc-per-node 99999`` would fork until the
    machine runs out of memory; 4 per core still oversubscribes enough to test a large world size."""
    return 4 * (os.cpu_count() or 1)


def check_timeout(seconds: float) -> None:
    """Reject a --timeout that is not a finite number of seconds in (0, MAX_TIMEOUT_S]."""
    if not math.isfinite(seconds) or not 0 < seconds <= MAX_TIMEOUT_S:
        raise OptionError(f"--timeout {seconds:g}: need a finite number of seconds, more than 0 and at "
                          f"most {MAX_TIMEOUT_S:g} (24 h)")


def _import_torch():
    """torch, or an :class:`OptionError` saying why it cannot be imported (a broken torch_npu
    typically: torch imports it through its backend entry point when CANN is not set up)."""
    try:
        import torch  # pylint: disable=import-outside-toplevel
    except Exception as exc:  # noqa: BLE001 - torch_npu's import errors are RuntimeError, ImportError, ...
        root = exc.__cause__ or exc.__context__ or exc
        why = f"{type(root).__name__}: {(str(root).strip().splitlines() or [''])[0]}"
        if importlib.util.find_spec("torch_npu") is not None:
            raise OptionError(f"torch cannot be imported: it loads the installed torch_npu at startup, which "
                              f"failed ({why}): source CANN's set_env.sh, or set "
                              "TORCH_DEVICE_BACKEND_AUTOLOAD=0 to run the checks on cpu without torch_npu") from None
        raise OptionError(f"torch cannot be imported ({why})") from None
    return torch


def _check_numpy() -> None:
    try:
        import numpy  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    except Exception as exc:  # noqa: BLE001 - a broken numpy raises more than ImportError
        raise OptionError(f"numpy cannot be imported ({type(exc).__name__}: {exc}): the ranks need it "
                          "(torch.distributed's object collectives and torch.distributed.checkpoint call "
                          "Tensor.numpy()); install numpy into this environment") from None


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


def resolve(args: argparse.Namespace, records: dict) -> Plan:
    """The plan for these options; raises :class:`OptionError` for a device, backend or N that cannot run,
    or an environment the checks cannot run in (torch or numpy not importable, a pod without launcher)."""
    from .checks import why_not  # pylint: disable=import-outside-toplevel

    check_timeout(args.timeout)
    wanted = _select(args.only)
    kind = job_kind()
    if kind == "pod" and args.nproc_per_node is None:
        raise OptionError(pod_error())
    _check_numpy()   # first: torch without numpy warns at import
    torch = _import_torch()
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
    job = kind in ("torchrun", "srun")
    if job:
        job_env()
    if job and args.nproc_per_node is not None:
        raise OptionError("--nproc-per-node: inside a torchrun job or srun step the job's own ranks run "
                          "the checks; drop the option")
    nproc = args.nproc_per_node if args.nproc_per_node is not None else (count or CPU_RANKS)
    if nproc < 1:
        raise OptionError(f"--nproc-per-node {nproc}: need at least 1 rank")
    if device == "cpu" and nproc > max_cpu_ranks() and not job:
        raise OptionError(f"--nproc-per-node {nproc}: at most {max_cpu_ranks()} cpu ranks on this node "
                          f"(4 per core of its {os.cpu_count() or 1}); each rank is a process")
    if device != "cpu" and nproc > count and not job:
        raise OptionError(f"--nproc-per-node {nproc}: only {count} {device} device(s) visible on this node")
    if args.workdir and not os.path.isdir(args.workdir):
        raise OptionError(f"--workdir {args.workdir}: not an existing folder")
    skipped = {name: why_not(name, records) for name in wanted}
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
