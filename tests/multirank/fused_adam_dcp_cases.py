"""Rank-side DCP cases for FusedAdam: save at 2 ranks, resume at 2, 1 or 4
(docs/design.md#41-te_fused_adam_dtensor, #5-test-rules)."""
from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from npu_fsdp_patches.optim import FusedAdam
from tests.multirank.dtensors import distribute_same
from tests.multirank.fused_adam_cases import LR, WD, full_of, like
from tests.support import Checks


SPECS = {"w7": ((7,), torch.float32, [Shard(0)]), "w1": ((1,), torch.float32, [Shard(0)]),
         "m73": ((7, 3), torch.bfloat16, [Shard(0)]), "r5": ((5,), torch.float16, [Replicate()])}
STATES = ("exp_avg", "exp_avg_sq", "master_param")
#: one check per param and per state of it, after resuming: each is one pytest test
CHECKS = tuple(f"dcp {name} {what}" for name in SPECS for what in ("param", *STATES))


def _dcp_model(mesh, seed: int):
    gen = torch.Generator().manual_seed(seed)
    params = {}
    for name, (shape, dtype, placements) in SPECS.items():
        full = torch.randn(shape, generator=gen).to(dtype)
        params[name] = torch.nn.Parameter(distribute_same(full, mesh, placements))
    opt = FusedAdam(list(params.values()), lr=LR, weight_decay=WD, master_weights=True,
                    exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.bfloat16,
                    use_decoupled_grad=True)
    return params, opt


def _dcp_steps(params, opt, first: int, last: int):
    for i in range(first, last):
        gen = torch.Generator().manual_seed(100 + i)
        for p in params.values():
            p.decoupled_grad = like(p, torch.randn(p.shape, generator=gen))
        opt.step()


def _full_snapshot(params, opt):
    """Full params and unscaled states, each cast to its storage dtype (the precision it holds).

    fp16 scales are per local shard (docs/te_fused_adam.md#rfc-335-scaling), so after resharding an fp16 state
    is re-rounded with a different scale: comparing in the storage dtype gives that dtype's tolerance.
    """
    out = {}
    for i, (name, p) in enumerate(params.items()):
        states = {k: full_of(v).to(opt.state[p][k].dtype)
                  for k, v in opt.state_dict()["state"][i].items()}
        out[name] = (full_of(p.detach()), states)
    return out


def dcp_save_and_resume(rank: int, world: int, ckpt: str, ref_path: str):
    """Train 3 steps, DCP-save, run 2 more (the reference); reload at this world size, compare."""
    import torch.distributed.checkpoint as dcp
    mesh = init_device_mesh("cpu", (world,))
    params, opt = _dcp_model(mesh, seed=11)
    _dcp_steps(params, opt, 0, 3)
    dcp.save({"model": dict(params), "optim": opt.state_dict()}, checkpoint_id=ckpt)
    _dcp_steps(params, opt, 3, 5)
    reference = _full_snapshot(params, opt)
    if rank == 0:
        torch.save(reference, ref_path)
    return _resume_and_compare(mesh, ckpt, reference)


def _resume_and_compare(mesh, ckpt, reference):
    import torch.distributed.checkpoint as dcp
    params, opt = _dcp_model(mesh, seed=99)  # different init: everything must come from disk
    for p in params.values():
        opt.initialize_state(p)
    template = {"model": dict(params), "optim": opt.state_dict()}
    dcp.load(template, checkpoint_id=ckpt)
    opt.load_state_dict(template["optim"])
    steps = [g["step"] for g in opt.param_groups]
    _dcp_steps(params, opt, 3, 5)
    got = _full_snapshot(params, opt)
    checks = Checks()
    for name, (ref_p, ref_states) in reference.items():
        checks.run(f"dcp {name} param", lambda: torch.testing.assert_close(got[name][0], ref_p))
        for k, ref in ref_states.items():
            # TE's own tolerance for fp16-stored moments (test_fused_optimizer.py: 2e-3)
            tol = dict(rtol=2e-3, atol=2e-3) if ref.dtype == torch.float16 else {}
            checks.run(f"dcp {name} {k}", lambda k=k, ref=ref, tol=tol:
                       torch.testing.assert_close(got[name][1][k], ref, **tol))
    local_numels = {n: p._local_tensor.numel() for n, p in params.items()}
    return {"checks": checks.results, "steps_after_load": steps, "local_numels": local_numels}


def dcp_resume_other_world(rank: int, world: int, ckpt: str, ref_path: str):
    """Load the 2-rank checkpoint at ``world`` ranks, continue, compare with the 2-rank reference."""
    mesh = init_device_mesh("cpu", (world,))
    return _resume_and_compare(mesh, ckpt, torch.load(ref_path))
