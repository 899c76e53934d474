"""One rank of the self-test: ``python -m npu_fsdp_patches.selftest.rank PLAN.json`` under torchrun,
or :func:`run_rank` inside an existing torchrun job / srun step.

The rank joins the process group on its device, runs the planned checks in order and, when the plan
names a status folder, rewrites ``rank<R>.json`` there before and after every check, which is how the
launcher shows progress and names a rank that hangs or dies.
"""
from __future__ import annotations

import datetime
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from typing import Callable, Optional

from . import checks
from .options import Plan
from .checks.plant import misbehave


def job_env() -> dict:
    """rank, world_size, local_rank and the rendezvous address from torchrun's or Slurm's env vars."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world, local = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
    else:
        rank, world, local = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0))
    addr = env.get("MASTER_ADDR") or env.get("SLURM_LAUNCH_NODE_IPADDR")
    if not addr:
        raise RuntimeError("MASTER_ADDR is not set: export MASTER_ADDR (the first node's address) "
                           "and MASTER_PORT before srun")
    return {"rank": rank, "world_size": world, "local_rank": local, "master_addr": addr,
            "master_port": env.get("MASTER_PORT", "29500")}


class StatusFile:
    """``rank<R>.json`` in the plan's status folder (nothing when there is none), replaced atomically."""

    def __init__(self, folder: str, rank: int) -> None:
        self.path = os.path.join(folder, f"rank{rank}.json") if folder else ""
        self.data = {"rank": rank, "pid": os.getpid(), "current": None, "last": None, "started": None,
                     "results": {}, "done": False, "error": None}
        self.write()

    def update(self, **changes) -> None:
        self.data.update(changes)
        self.write()

    def write(self) -> None:
        if not self.path:
            return
        with open(self.path + ".tmp", "w", encoding="utf-8") as fh:
            json.dump(self.data, fh, default=str)
        os.replace(self.path + ".tmp", self.path)


def _set_device(torch, device: str, local_rank: int):
    if device == "npu":
        import torch_npu  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    if device == "cpu":
        return torch.device("cpu")
    getattr(torch, device).set_device(local_rank)
    return torch.device(device, local_rank)


def run_check(name: str, ctx) -> dict:
    """Run one check; an exception is a failed check carrying its traceback tail."""
    start = time.monotonic()
    try:
        result = checks.load(name).run(ctx)
    except Exception as exc:  # noqa: BLE001 - reported as this check's failure
        result = {"passed": False, "error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()[-3000:]}
    result["seconds"] = round(time.monotonic() - start, 3)
    return result


def run_rank(plan: Plan, on_result: Optional[Callable[[str, list], None]] = None,
             status: Optional[StatusFile] = None) -> list:
    """Run ``plan.checks`` on this rank; returns, on every rank, every rank's results per check.

    ``on_result(name, per_rank_results)`` is called on rank 0 after each check (progress lines).
    """
    import torch  # pylint: disable=import-outside-toplevel
    import torch.distributed as dist  # pylint: disable=import-outside-toplevel
    from torch.distributed.device_mesh import init_device_mesh  # pylint: disable=import-outside-toplevel

    from .checks.context import Context  # pylint: disable=import-outside-toplevel

    job = job_env()
    os.environ.setdefault("MASTER_ADDR", job["master_addr"])
    os.environ.setdefault("MASTER_PORT", job["master_port"])
    rank, world = job["rank"], job["world_size"]
    status = status or StatusFile(plan.status_dir, rank)
    device = _set_device(torch, plan.device, job["local_rank"])
    dist.init_process_group(plan.backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=plan.timeout))
    try:
        # one fresh folder for all ranks (DCP needs it shared), removed at the end
        workdir = [tempfile.mkdtemp(prefix="npu_fsdp_self_test_", dir=plan.workdir or None) if rank == 0 else None]
        dist.broadcast_object_list(workdir, src=0)
        ctx = Context(rank=rank, world=world, device=device, workdir=workdir[0],
                      mesh=init_device_mesh(device.type, (world,)))
        every = []
        for index, name in enumerate(plan.checks):
            status.update(current=name, started=time.time())
            if index == 0:
                misbehave(rank)
            result = run_check(name, ctx)
            status.data["results"][name] = result
            status.update(current=None, last=name)
            gathered = [None] * world
            dist.all_gather_object(gathered, result)
            every.append(gathered)
            if rank == 0 and on_result is not None:
                on_result(name, gathered)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(workdir[0], ignore_errors=True)
        status.update(done=True)
        return every
    finally:
        dist.destroy_process_group()


def main(argv: list) -> int:
    with open(argv[0], encoding="utf-8") as fh:
        plan = Plan(**json.load(fh))
    status = StatusFile(plan.status_dir, int(os.environ["RANK"]))
    try:
        run_rank(plan, status=status)
    except BaseException:  # noqa: BLE001 - written for the launcher, then the rank fails
        status.update(error=traceback.format_exc()[-3000:])
        raise
    # gloo's background threads can abort the interpreter at exit after all work is reported
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
