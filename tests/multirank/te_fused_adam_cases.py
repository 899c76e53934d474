"""Rank-side cases for the ``te_fused_adam_dtensor`` patch on a TE fixture (TENPU or NVTE 2.11).

The rank runs with a fixture distribution on PYTHONPATH; the plugin has already applied the patch on
``import transformer_engine...`` (the matrix enables it for both fixtures). Each case reverts and
re-applies it through the public API to compare unpatched and patched behaviour in one process.
"""
from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import npu_fsdp_patches
from npu_fsdp_patches.optim import FusedAdam as OurFusedAdam
from tests.multirank.dtensors import distribute_same
from tests.multirank.fused_adam_cases import full_of, like, ref_adam
from tests.support import Checks

PATCH = "te_fused_adam_dtensor"
#: every check ``te_patch_cases`` runs, one pytest test each
CHECKS = ("unpatched_fails", "patched_matches_standalone_and_reference", "rejections_on_te_class")


def _params(mesh, dtype=torch.float32):
    gen = torch.Generator().manual_seed(5)
    specs = ((7, [Shard(0)]), (1, [Shard(0)]), (5, [Replicate()]))
    return [torch.nn.Parameter(distribute_same(torch.randn(n, generator=gen).to(dtype), mesh, pl))
            for n, pl in specs]


def _grads(params, step, dtype):
    gen = torch.Generator().manual_seed(50 + step)
    return [like(p, torch.randn(p.shape, generator=gen).to(dtype)) for p in params]


def _train(cls, params, steps, decoupled=False, grad_dtype=None, **kw):
    opt = cls(params, lr=1e-2, weight_decay=0.1, use_decoupled_grad=decoupled, **kw)
    for s in range(steps):
        for p, g in zip(params, _grads(params, s, grad_dtype or params[0].dtype)):
            if decoupled:
                p.decoupled_grad = g
            else:
                p.grad = g
        opt.step()
    return opt


def te_patch_cases(rank: int, world: int):
    from transformer_engine.pytorch.optimizers import FusedAdam as BoundBefore
    from transformer_engine.pytorch.optimizers import fused_adam as te_module
    mesh = init_device_mesh("cpu", (world,))
    checks = Checks()
    facts = {"state": {r["name"]: r["state"] for r in npu_fsdp_patches.status()}[PATCH]}

    @checks("unpatched_fails")
    def unpatched_fails():
        npu_fsdp_patches.revert(PATCH)
        try:
            ps = _params(mesh)
            _train(te_module.FusedAdam, ps, 1)
        except Exception as exc:  # TENPU: NotImplementedError; NVTE 2.11: global-shape states
            facts["unpatched_error"] = f"{type(exc).__name__}: {exc}"
        else:
            facts["unpatched_error"] = None
        finally:
            npu_fsdp_patches.apply(PATCH)

    @checks("patched_matches_standalone_and_reference")
    def patched_matches_standalone_and_reference():
        TE = te_module.FusedAdam
        assert TE is BoundBefore, "the class object was replaced"
        assert getattr(TE.step, "__npu_fsdp_patch__", None) == PATCH, "step is not the replacement"
        for kw in (dict(), dict(master_weights=True, decoupled=True, grad_dtype=torch.float32),
                   dict(exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.bfloat16)):
            dtype = torch.bfloat16 if kw.get("master_weights") else torch.float32
            a, b = _params(mesh, dtype), _params(mesh, dtype)
            opt = _train(TE, a, 5, **kw)
            ours = _train(OurFusedAdam, b, 5, **kw)
            assert isinstance(opt, BoundBefore)
            for pa, pb in zip(a, b):  # same engine on both: bitwise
                assert torch.equal(pa._local_tensor, pb._local_tensor), kw
                for name, st in opt.state[pa].items():
                    assert isinstance(st, DTensor) and st.placements == pa.placements
                    assert st.shape == pa.shape and st.stride() == pa.stride(), name
                    assert torch.equal(st._local_tensor, ours.state[pb][name]._local_tensor)
            if not kw:
                fresh = _params(mesh)
                for i, (p, full) in enumerate(zip(a, fresh)):
                    grads = [full_of(_grads(fresh, s, torch.float32)[i]) for s in range(5)]
                    rp, _, _ = ref_adam(full_of(full.detach()), grads)
                    torch.testing.assert_close(full_of(p.detach()), rp.float(), rtol=1e-6,
                                               atol=1e-7)
            sd = opt.state_dict()
            for i, p in enumerate(a):
                for name, v in sd["state"][i].items():
                    assert isinstance(v, DTensor) and v.dtype == torch.float32, (i, name)
                    assert (v.placements, v.shape, v.stride()) == (p.placements, p.shape,
                                                                   p.stride())
            c = _params(mesh, dtype)
            with torch.no_grad():
                for x, y in zip(c, a):
                    x.copy_(y)
            opt2 = TE(c, lr=1e-2, weight_decay=0.1, use_decoupled_grad=kw.get("decoupled", False),
                      **{k: v for k, v in kw.items() if k not in ("decoupled", "grad_dtype")})
            opt2.load_state_dict(sd)
            assert [g["step"] for g in opt2.param_groups] == [5]
            for name in opt.state[a[0]]:
                torch.testing.assert_close(opt2.get_unscaled_state(c[0], name),
                                           opt.get_unscaled_state(a[0], name))

    @checks("rejections_on_te_class")
    def rejections_on_te_class():
        b = _params(mesh, torch.bfloat16)
        opt = te_module.FusedAdam(b, master_weights=True, store_param_remainders=True)
        try:
            opt.initialize_state(b[0], True)
        except RuntimeError as exc:
            assert "store_param_remainders" in str(exc) and "DTensor" in str(exc), exc
        else:
            raise AssertionError("remainders accepted on a DTensor param")
    return {"checks": checks.results, "facts": facts}
