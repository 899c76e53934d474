"""One rank of the self-test: ``python -m npu_fsdp_patches.selftest.rank PLAN.json`` under torchrun,
or :func:`run_rank` inside an existing torchrun job / srun step.

The rank joins the process group on its device, runs the planned checks in order and, when the plan
names a status folder, rewrites ``rank<R>.json`` there before and after every check, which is how the
launcher shows progress and names a rank that hangs or dies.
"""
from __future__ import annotations

import dataclasses
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
from .checks.plant import misbehave, planted
from .options import Plan, job_env
from .quick_exit import exit_without_teardown


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


def _applied() -> list:
    """The patches applied in this process so far."""
    import npu_fsdp_patches  # pylint: disable=import-outside-toplevel

    return sorted(r["name"] for r in npu_fsdp_patches.status() if r["state"] == "applied")


def run_check(name: str, ctx) -> dict:
    """Run one check; an exception is a failed check carrying its traceback tail.

    The result names ``patches``: the patch the check verifies (the patch that declares it) when it
    was applied, and ``applied``: every patch applied in this rank by the end of the check.
    """
    start = time.monotonic()
    patch = checks.CHECKS[name][1]
    try:
        result = checks.load(name)(dataclasses.replace(ctx, planted=planted(name), patch=patch))
    except Exception as exc:  # noqa: BLE001 - reported as this check's failure
        result = {"passed": False, "error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()[-3000:]}
    result["seconds"] = round(time.monotonic() - start, 3)
    result["applied"] = _applied()
    result["patches"] = [patch] if patch in result["applied"] and "skipped" not in result else []
    return result


def _make_workdir(plan: Plan) -> str:
    """Rank 0's folder for the checkpoints: named after the launcher's run (which removes it even
    when the ranks are killed), else a fresh temporary one."""
    if not plan.run_id:
        return tempfile.mkdtemp(prefix="npu_fsdp_self_test_", dir=plan.workdir or None)
    path = os.path.join(plan.workdir or tempfile.gettempdir(), f"npu_fsdp_self_test_{plan.run_id}")
    os.makedirs(path)
    return path


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
        workdir = [_make_workdir(plan) if rank == 0 else None]
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
    exit_without_teardown(0)   # all is reported: gloo's threads cannot abort it at teardown


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
