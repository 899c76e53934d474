"""Rank-side code of tests/clients/test_torchtitan.py: ``RebuildMainParamsPlanner``'s refusals through
torchtitan 0.3.0's ``CheckpointManager`` (2 gloo ranks), with the example's containers and manager
(examples/torchtitan_main_params.py, on the rank's path).

A checkpoint holding the fp32 main params of some params only is refused naming the others, before the
model or optimizer changes; a checkpoint missing any other optimizer entry is refused as by torch's
default planner. Each checkpoint is written by torchtitan's own ``CheckpointManager`` from a container
whose flat state dict leaves out one entry.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh

from tests.support import Checks, bit_mismatches

CHECKS = ("partial_refused_before_writing", "other_missing_keys_still_refused")


def save_without(example, container: type, key: str, folder: str, mesh) -> None:
    """Train ``container`` 2 steps, then save with torchtitan's CheckpointManager, ``key`` left out."""
    model, optimizers, lr_schedulers = example.build(container, mesh, torch.device("cpu"))
    example.train(model, optimizers, lr_schedulers, range(example.SAVE_AFTER), torch.device("cpu"))
    whole = optimizers.state_dict
    optimizers.state_dict = lambda: {k: v for k, v in whole().items() if k != key}
    example.checkpointer(example.CheckpointManager, folder, model, optimizers, lr_schedulers).save(
        curr_step=example.SAVE_AFTER)


def snapshot(model, optimizers) -> dict:
    opt = optimizers.optimizers[0]
    out = {f"param.{n}": p.full_tensor() for n, p in model.named_parameters()}
    for p, state in opt.state.items():
        out.update({f"state.{opt.fqn(p)}.{k}": v.full_tensor() if hasattr(v, "full_tensor") else v.clone()
                    for k, v in state.items() if torch.is_tensor(v)})
    return out


def refused_load(example, folder: str, mesh) -> tuple[str, dict, dict]:
    """Load ``folder`` into a fresh wrapped container through the planner's manager: (the
    CheckpointException's text, the state before, the state after)."""
    model, optimizers, lr_schedulers = example.build(example.MainParamsOptimizersContainer, mesh,
                                                     torch.device("cpu"))
    optimizers.state_dict()       # torchtitan primes the fresh optimizers' state here, as its load does
    before = snapshot(model, optimizers)
    manager = example.checkpointer(example.RebuildMainParamsCheckpointManager, folder, model, optimizers,
                                   lr_schedulers)
    try:
        manager.load()
    except dcp.api.CheckpointException as exc:
        text = str(exc)
    else:
        text = "the load went through"
    return text, before, snapshot(model, optimizers)


def case(rank: int, world: int, root: str) -> dict:
    import torchtitan_main_params as example     # here: importing it without torchtitan exits 2
    checks = Checks()
    mesh = init_device_mesh("cpu", (world,))
    save_without(example, example.MainParamsOptimizersContainer, "state.layers.0.wq.weight.main_param",
                 f"{root}/partial", mesh)
    save_without(example, example.OptimizersContainer, "state.layers.1.wo.weight.exp_avg", f"{root}/no_moment", mesh)
    partial = refused_load(example, f"{root}/partial", mesh)
    no_moment = refused_load(example, f"{root}/no_moment", mesh)

    @checks("partial_refused_before_writing")
    def partial_refused_before_writing():
        text, before, after = partial
        assert "optimizer state is incomplete" in text and "layers.0.wq.weight" in text, text
        assert "nothing was written" in text, text
        changed = {k: n for k in before if (n := bit_mismatches(before[k], after[k])[0])}
        assert changed == {} and set(before) == set(after), changed

    @checks("other_missing_keys_still_refused")
    def other_missing_keys_still_refused():
        text = no_moment[0]
        assert "Missing key in checkpoint state_dict: optimizer.state.layers.1.wo.weight.exp_avg" in text, text

    dist.barrier()
    return {"checks": checks.results}
