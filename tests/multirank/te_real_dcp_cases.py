"""DCP on TE's real FusedAdam (tests/te_real.py): save at 2 ranks, load at 3, continue, compare.

The model mixes an fp32 and bf16 params with fp32 master weights, fp16 / bf16 moments and decoupled
grads; its last param has an empty shard on ranks >= 1 (TE#3212). The 2-rank run keeps training to
5 steps as the reference; the 3-rank run builds a differently initialised model, loads the
checkpoint through ``torch.distributed.checkpoint`` and TE's ``load_state_dict``, and continues.
"""
from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from tests.multirank.dtensors import distribute_same
from tests.multirank.fused_adam_cases import LR, WD
from tests.multirank.fused_adam_dcp_cases import _dcp_steps, _full_snapshot

_SPECS = {"w7": ((7,), torch.float32, [Shard(0)]), "m73": ((7, 3), torch.bfloat16, [Shard(0)]),
          "r5": ((5,), torch.bfloat16, [Replicate()]), "w1": ((1,), torch.bfloat16, [Shard(0)])}


def _model(mesh, seed: int):
    from transformer_engine.pytorch.optimizers import FusedAdam
    gen = torch.Generator().manual_seed(seed)
    params = {name: torch.nn.Parameter(distribute_same(torch.randn(shape, generator=gen).to(dtype), mesh, pl))
        for name, (shape, dtype, pl) in _SPECS.items()}
    opt = FusedAdam(list(params.values()), lr=LR, weight_decay=WD, master_weights=True,
                    exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.bfloat16,
                    use_decoupled_grad=True)
    return params, opt


def save_and_continue(rank: int, world: int, ckpt: str, ref_path: str) -> dict:
    import torch.distributed.checkpoint as dcp
    params, opt = _model(init_device_mesh("cpu", (world,)), seed=11)
    _dcp_steps(params, opt, 0, 3)
    dcp.save({"model": dict(params), "optim": opt.state_dict()}, checkpoint_id=ckpt)
    _dcp_steps(params, opt, 3, 5)
    snapshot = _full_snapshot(params, opt)  # collectives: every rank
    if rank == 0:
        torch.save(snapshot, ref_path)
    return {"local_numels": {n: p._local_tensor.numel() for n, p in params.items()}}


def load_and_continue(rank: int, world: int, ckpt: str, ref_path: str) -> dict:
    import torch.distributed.checkpoint as dcp
    params, opt = _model(init_device_mesh("cpu", (world,)), seed=99)
    for p in params.values():
        opt.initialize_state(p, False)
    for group in opt.param_groups:  # TE adds "step" at the first step(); DCP fills only known keys
        group.setdefault("step", 0)
    template = {"model": dict(params), "optim": opt.state_dict()}
    dcp.load(template, checkpoint_id=ckpt)
    opt.load_state_dict(template["optim"])
    steps = [g["step"] for g in opt.param_groups]
    _dcp_steps(params, opt, 3, 5)
    got, ref = _full_snapshot(params, opt), torch.load(ref_path)
    err = {}
    for name, (ref_p, ref_states) in ref.items():
        err[name] = float((got[name][0].double() - ref_p.double()).abs().max())
        for k, v in ref_states.items():
            err[f"{name}.{k}"] = float((got[name][1][k].double() - v.double()).abs().max())
    return {"steps_after_load": steps, "max_err": err,
            "local_numels": {n: p._local_tensor.numel() for n, p in params.items()}}
