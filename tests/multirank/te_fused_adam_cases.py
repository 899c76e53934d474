"""Rank-side cases for the ``te_fused_adam_dtensor`` patch on a TE fixture (TENPU or NVTE 2.11).

The rank runs with a fixture distribution on PYTHONPATH; the plugin has already applied the patch on
``import transformer_engine...`` (the matrix enables it for both fixtures). Each case reverts and
re-applies it through the public API to compare unpatched and patched behaviour in one process. The
same launch also checks plain-tensor training (bitwise the original class) and, on NVTE 2.11,
``te_initialize_state_compat``'s one-argument ``initialize_state`` (each was a fresh interpreter of its
own: one launch for the facts of one set-up, docs/contributing.md).
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
#: the DTensor checks ``te_patch_cases`` runs, one pytest test each
CHECKS = ("unpatched_fails", "patched_matches_standalone_and_reference", "rejections_on_te_class")
#: plain tensors: the patched step is bitwise the original class's, on every flavor
PLAIN_CHECK = "plain_tensor_training_is_bitwise_the_original"
#: NVTE 2.11 only (TENPU's stand-in already defaults the argument): te_initialize_state_compat
INIT_STATE_CHECK = "initialize_state_one_argument"
#: every check the launch of each flavor runs
DECLARED = {"tenpu": CHECKS + (PLAIN_CHECK,), "nvte211": CHECKS + (PLAIN_CHECK, INIT_STATE_CHECK)}


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


def _plain_train(te_cls, **kw):
    gen = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(n, generator=gen).to(dt))
          for n, dt in ((33, torch.float32), (5, torch.float32))]
    opt = te_cls(ps, lr=1e-2, weight_decay=0.1, **kw)
    for _ in range(6):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()
    return [p.detach().clone() for p in ps], opt.state_dict()


def plain_tensor_training_is_bitwise_the_original(te_cls) -> None:
    """Reverted vs applied on plain tensors: parameters and states bitwise equal, 1-ulp control."""
    for kw in ({}, {"adam_w_mode": False}, {"exp_avg_dtype": torch.float16},
               {"master_weights": True, "exp_avg_sq_dtype": torch.bfloat16}):
        npu_fsdp_patches.revert(PATCH)
        assert not hasattr(te_cls.step, "__npu_fsdp_patch__")
        ref, ref_sd = _plain_train(te_cls, **kw)
        npu_fsdp_patches.apply(PATCH)
        assert te_cls.step.__npu_fsdp_patch__ == PATCH
        got, got_sd = _plain_train(te_cls, **kw)
        for a, b in zip(got, ref):
            assert torch.equal(a, b), kw
            assert not torch.equal(a, torch.nextafter(b, torch.full_like(b, 1e9))), "1-ulp control"
        for k in ref_sd["state"]:
            for name, v in ref_sd["state"][k].items():
                assert torch.equal(got_sd["state"][k][name], v), (kw, name)


def initialize_state_one_argument(te_cls) -> None:
    """NVTE 2.11 needs initialize_state's second argument; te_initialize_state_compat derives it and
    refuses a contradicting one."""
    compat = "te_initialize_state_compat"
    p = torch.nn.Parameter(torch.randn(4).bfloat16())
    f = torch.nn.Parameter(torch.randn(4))
    npu_fsdp_patches.revert(compat)
    try:
        te_cls([p], master_weights=True).initialize_state(p)
    except TypeError as e:
        assert "store_param_remainders" in str(e), e
    else:
        raise AssertionError("one-argument call worked without the patch")
    finally:
        npu_fsdp_patches.apply(compat)
    opt = te_cls([p, f], master_weights=True, store_param_remainders=True)
    opt.initialize_state(p)
    opt.initialize_state(f)
    assert opt.state[p]["master_param"].dtype == torch.int16   # derived: bf16 + fp32 master
    assert opt.state[f]["master_param"].dtype == torch.float32  # derived: fp32 param
    opt.initialize_state(f, False)  # an explicit value that agrees
    for param, value in ((p, False), (f, True)):
        try:
            te_cls([param], master_weights=True, store_param_remainders=True).initialize_state(param, value)
        except ValueError as e:
            assert "contradicts" in str(e), e
        else:
            raise AssertionError("contradicting value accepted")


def te_patch_cases(rank: int, world: int, flavor: str, fixes_dir: str | None = None):
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

    checks.run(PLAIN_CHECK, lambda: plain_tensor_training_is_bitwise_the_original(te_module.FusedAdam))
    if INIT_STATE_CHECK in DECLARED[flavor]:
        checks.run(INIT_STATE_CHECK, lambda: initialize_state_one_argument(te_module.FusedAdam))
    out = {"checks": checks.results, "facts": facts}
    if fixes_dir is not None:   # te_fused_adam_empty_group_step on this class (tests/test_te_real.py's cases)
        from tests.multirank.te_step_counter_cases import counter_cases
        out["counter"] = counter_cases(rank, world, fixes_dir)
    return out
