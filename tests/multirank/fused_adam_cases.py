"""Rank-side cases for FusedAdam on torch DTensor / gloo (the test matrix of
docs/te_fused_adam.md#rfc-42-test-matrix, docs/design.md#41-te_fused_adam_dtensor).

Each public function runs many named checks in one launch (``tests.support.Checks``) and returns
their results plus small facts the pytest side asserts on, so one launch costs one interpreter
start-up. ``NUMERICS_CHECKS`` and ``PRECISION_CHECKS`` name every check, one pytest test each.
"""
from __future__ import annotations

import contextlib
import itertools

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.utils._python_dispatch import TorchDispatchMode

from npu_fsdp_patches.optim import FusedAdam
from tests.multirank.dtensors import distribute_same
from tests.support import Checks

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.999), 1e-8, 0.1
LAYOUTS = ("tensor", "shard", "replicate")


# ----------------------------------------------------------------------------- helpers

def make_param(layout: str, full: torch.Tensor, mesh) -> torch.nn.Parameter:
    if layout == "tensor":
        return torch.nn.Parameter(full.clone())
    placements = [Shard(0)] if layout == "shard" else [Replicate()]
    return torch.nn.Parameter(distribute_same(full.clone(), mesh, placements))


def like(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """A grad/value with ``param``'s layout, cut locally from the same full tensor on every rank."""
    if isinstance(param, DTensor):
        return distribute_same(full, param.device_mesh, param.placements)
    return full


def full_of(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def set_grad(param, full_grad, decoupled: bool) -> None:
    g = like(param, full_grad)
    if decoupled:
        param.decoupled_grad = g
    else:
        param.grad = g


def ref_adam(p0: torch.Tensor, grads, *, lr=LR, betas=BETAS, eps=EPS, wd=WD, l2=False):
    """Manual Adam/AdamW on the full tensor, in float64."""
    p = p0.double()
    m = torch.zeros_like(p)
    v = torch.zeros_like(p)
    b1, b2 = betas
    for t, g in enumerate(grads, 1):
        g = g.double()
        if l2:
            g = g + wd * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        mh, vh = m / (1 - b1 ** t), v / (1 - b2 ** t)
        if not l2:
            p = p * (1 - lr * wd)
        p = p - lr * mh / (vh.sqrt() + eps)
    return p, m, v


def expect_error(exc_type, *needles):
    @contextlib.contextmanager
    def ctx():
        try:
            yield
        except exc_type as exc:
            missing = [n for n in needles if n not in str(exc)]
            if missing:
                raise AssertionError(f"message {str(exc)!r} lacks {missing}")
            return
        raise AssertionError(f"{exc_type.__name__} not raised")
    return ctx()


class CollectiveCounter(TorchDispatchMode):
    """Counts c10d ops seen by dispatch plus calls of the eager torch.distributed collectives."""

    NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
             "reduce_scatter_tensor", "broadcast", "all_to_all", "all_to_all_single", "barrier",
             "send", "recv", "isend", "irecv", "gather", "scatter", "reduce", "all_gather_object",
             "broadcast_object_list")

    def __init__(self):
        super().__init__()
        self.calls = []
        self._saved = {}

    def __enter__(self):
        for name in self.NAMES:
            orig = getattr(dist, name)
            self._saved[name] = orig

            def counted(*a, __name=name, __orig=orig, **k):
                self.calls.append(__name)
                return __orig(*a, **k)
            setattr(dist, name, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, orig in self._saved.items():
            setattr(dist, name, orig)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "c10d" in str(func.namespace):
            self.calls.append(str(func))
        return func(*args, **(kwargs or {}))


# ----------------------------------------------------------------------------- launch 1

#: layouts x numel x grad source x (AdamW, L2), each 5 steps vs the float64 reference
REFERENCE_CASES = tuple(itertools.product(LAYOUTS, (1, 7), (False, True), (False, True)))


def _reference_label(layout: str, numel: int, decoupled: bool, l2: bool) -> str:
    return f"ref[{layout},{numel},{'decoupled' if decoupled else 'grad'},{'l2' if l2 else 'w'}]"


NUMERICS_CHECKS = (*(_reference_label(*case) for case in REFERENCE_CASES),
                   "layout_rules", "empty_shards", "no_collectives", "rejections")


def numerics_matrix(rank: int, world: int):
    """fp32 reference matrix, layout rules, empty shards, no collectives, rejections."""
    mesh = init_device_mesh("cpu", (world,))
    checks = Checks()
    facts: dict = {}
    gen = torch.Generator().manual_seed(1234)

    # 1. layouts x numel x grad source x (AdamW, L2), 5 steps vs the float64 reference
    for layout, numel, decoupled, l2 in REFERENCE_CASES:
        label = _reference_label(layout, numel, decoupled, l2)

        def run(layout=layout, numel=numel, decoupled=decoupled, l2=l2):
            p0 = torch.randn(numel, generator=gen)
            grads = [torch.randn(numel, generator=gen) for _ in range(5)]
            p = make_param(layout, p0, mesh)
            opt = FusedAdam([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                            adam_w_mode=not l2, use_decoupled_grad=decoupled)
            for g in grads:
                set_grad(p, g, decoupled)
                kept = full_of(p.decoupled_grad if decoupled else p.grad).clone()
                opt.step()
                torch.testing.assert_close(full_of(p.decoupled_grad if decoupled else p.grad),
                                           kept, rtol=0, atol=0)  # the grad is never mutated
                opt.zero_grad()
            rp, rm, rv = ref_adam(p0, grads, l2=l2)
            torch.testing.assert_close(full_of(p.detach()), rp.float(), rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(full_of(opt.state[p]["exp_avg"]), rm.float(),
                                       rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(full_of(opt.state[p]["exp_avg_sq"]), rv.float(),
                                       rtol=1e-6, atol=1e-7)
        checks.run(label, run)

    # 2. state layout: DTensor with the param's mesh/placements/global shape/stride, keyed by param
    @checks("layout_rules")
    def layout_rules():
        for layout in ("shard", "replicate"):
            p = make_param(layout, torch.randn(7, 3, generator=gen), mesh)
            opt = FusedAdam([p], master_weights=True, exp_avg_dtype=torch.float16,
                            exp_avg_sq_dtype=torch.bfloat16)
            p.grad = like(p, torch.randn(7, 3, generator=gen))
            opt.step()
            assert list(opt.state.keys())[0] is p, "state is not keyed by the original param"
            # TE keeps a [1] fp32 scale for every non-fp32 state; bf16's stays 1 (stored unscaled)
            assert set(opt._scales[p]) == {"exp_avg", "exp_avg_sq"}, opt._scales.get(p)
            assert float(opt._scales[p]["exp_avg_sq"]) == 1.0
            for name, dtype in (("exp_avg", torch.float16), ("exp_avg_sq", torch.bfloat16),
                                ("master_param", torch.float32)):
                s = opt.state[p][name]
                assert isinstance(s, DTensor), f"{layout} {name} is {type(s)}"
                assert (s.device_mesh, s.placements, s.shape, s.stride()) == \
                    (p.device_mesh, p.placements, p.shape, p.stride()), f"{layout} {name} layout"
                assert s._local_tensor.shape == p._local_tensor.shape
                assert s._local_tensor.dtype == dtype
            bf = opt.get_unscaled_state(p, "exp_avg_sq", skip_unscale=True)
            assert bf.dtype == torch.bfloat16 and bf is opt.state[p]["exp_avg_sq"]._local_tensor
            assert opt.get_unscaled_state(p, "exp_avg_sq").dtype == torch.float32

    # 3. empty local shard (numel 1 on 2 ranks): no aminmax on empty, no kernel input, equal steps
    @checks("empty_shards")
    def empty_shards():
        kernel_sizes, real_fused, real_aminmax = [], torch._fused_adamw_, torch.aminmax

        def fused(params, *a, **k):
            kernel_sizes.append([t.numel() for t in params])
            return real_fused(params, *a, **k)

        def aminmax(t, *a, **k):
            if t.numel() == 0:
                raise AssertionError("aminmax on an empty tensor")
            return real_aminmax(t, *a, **k)
        torch._fused_adamw_, torch.aminmax = fused, aminmax
        try:
            p = make_param("shard", torch.randn(1, generator=gen), mesh)
            q = make_param("shard", torch.randn(1, generator=gen).half(), mesh)
            opt = FusedAdam([{"params": [p]}, {"params": [q]}], exp_avg_dtype=torch.float16,
                            master_weights=True, master_weight_dtype=torch.float16)
            for _ in range(3):
                p.grad = like(p, torch.randn(1, generator=gen))
                q.grad = like(q, torch.randn(1, generator=gen).half())
                opt.step()
            steps = [g["step"] for g in opt.param_groups]
        finally:
            torch._fused_adamw_, torch.aminmax = real_fused, real_aminmax
        facts["empty"] = {"local_numel": p._local_tensor.numel(), "kernel_sizes": kernel_sizes,
                          "steps": steps,
                          "scale": float(opt._scales[q]["exp_avg"]) if p._local_tensor.numel() == 0
                          else None}

    # 4. no collectives during step()
    @checks("no_collectives")
    def no_collectives():
        ps = [make_param(lay, torch.randn(n, generator=gen), mesh)
              for lay, n in itertools.product(("shard", "replicate"), (1, 7))]
        opt = FusedAdam(ps, master_weights=True, exp_avg_dtype=torch.float16)
        for p in ps:
            p.grad = like(p, torch.randn(p.shape, generator=gen))
        probe = CollectiveCounter()
        with probe:  # the counter itself must see a collective when there is one
            dist.barrier()
            ps[0].full_tensor()
        assert probe.calls, "collective counter saw nothing"
        counter = CollectiveCounter()
        with counter:
            opt.step()
            opt.step()
        facts["collectives_in_step"] = counter.calls

    # 5. rejections with clear messages
    @checks("rejections")
    def rejections():
        partial = torch.nn.Parameter(DTensor.from_local(torch.randn(3), mesh, [Partial()],
                                                        run_check=False))
        with expect_error(RuntimeError, "Partial", "param 0 of param group 0"):
            opt = FusedAdam([partial])
            partial.grad = DTensor.from_local(torch.randn(3), mesh, [Partial()], run_check=False)
            opt.step()
        p = make_param("shard", torch.randn(8, generator=gen), mesh)
        opt = FusedAdam([p], use_decoupled_grad=True)  # decoupled_grad may have any shape
        for grad, needle in ((like(p, torch.randn(8)).redistribute(mesh, [Replicate()]),
                              "placements"),
                             (distribute_same(torch.randn(10), mesh, [Shard(0)]), "global shape"),
                             (torch.randn(8), "plain-tensor gradient")):
            p.decoupled_grad = grad
            with expect_error(RuntimeError, needle, "param 0 of param group 0"):
                opt.step()
        sub = init_device_mesh("cpu", (world,), mesh_dim_names=("other",))
        p.decoupled_grad = distribute_same(torch.randn(8), sub, [Shard(0)])
        with expect_error(RuntimeError, "device_mesh"):
            opt.step()
        b = make_param("shard", torch.randn(8, generator=gen).bfloat16(), mesh)
        with expect_error(RuntimeError, "store_param_remainders", "DTensor"):
            FusedAdam([b], master_weights=True, store_param_remainders=True).initialize_state(b)
        with expect_error(RuntimeError, "FP8", "exp_avg_dtype"):
            FusedAdam([b], exp_avg_dtype=torch.uint8).initialize_state(b)
        with expect_error(RuntimeError, "AMSGrad"):
            FusedAdam([b], amsgrad=True)
        with expect_error(RuntimeError, "fp32/fp16 master"):
            FusedAdam([b], master_weights=True, master_weight_dtype=torch.bfloat16)
        with expect_error(RuntimeError, "capturable"):
            FusedAdam([b], capturable=True)
    return {"checks": checks.results, "facts": facts}


# ----------------------------------------------------------------------------- launch 2

MOMENT_PAIRS = ((torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
                (torch.float16, torch.float32), (torch.float32, torch.bfloat16))
MASTER_CASES = ((torch.float16, torch.float32), (torch.bfloat16, torch.float32),
                (torch.float16, torch.float16), (torch.bfloat16, torch.float16))


def _precision_configs():
    for m, v in MOMENT_PAIRS:
        yield (f"moments {m}/{v}", torch.float16,
               dict(exp_avg_dtype=m, exp_avg_sq_dtype=v))
    for pdt, mdt in MASTER_CASES:
        yield (f"master {pdt}->{mdt}", pdt,
               dict(master_weights=True, master_weight_dtype=mdt, use_decoupled_grad=True))


def _assert_state_dict_metadata(sd, params, opt_kwargs, step):
    names = {"exp_avg", "exp_avg_sq"} | ({"master_param"} if opt_kwargs.get("master_weights")
                                         else set())
    assert sorted(sd["state"]) == list(range(len(params))), sorted(sd["state"])
    assert [g["step"] for g in sd["param_groups"]] == [step], sd["param_groups"]
    for i, p in enumerate(params):
        entry = sd["state"][i]
        assert set(entry) == names, (i, set(entry))
        for name, value in entry.items():
            assert value.dtype == torch.float32, (i, name, value.dtype)
            if isinstance(p, DTensor):
                assert isinstance(value, DTensor), (i, name, type(value))
                assert (value.device_mesh, value.placements, value.shape, value.stride()) == \
                    (p.device_mesh, p.placements, p.shape, p.stride()), (i, name)
            else:
                assert type(value) is torch.Tensor and value.shape == p.shape, (i, name)


PRECISION_CHECKS = (*(f"{label} {layout}" for (label, _, _), layout
                       in itertools.product(list(_precision_configs()), LAYOUTS)),
                    "remainders_plain")


def precision_checkpoints(rank: int, world: int):
    """Low-precision moments and master weights x layouts: reference, state_dict, load, continue."""
    mesh = init_device_mesh("cpu", (world,))
    checks = Checks()
    for (label, pdtype, kwargs), layout in itertools.product(list(_precision_configs()), LAYOUTS):
        def run(pdtype=pdtype, kwargs=kwargs, layout=layout):
            gen = torch.Generator().manual_seed(7)
            fulls = [torch.randn(7, generator=gen), torch.randn(1, generator=gen)]
            grads = [[torch.randn(f.shape, generator=gen) for f in fulls] for _ in range(5)]
            decoupled = kwargs.get("use_decoupled_grad", False)

            def make():
                ps = [make_param(layout, f.to(pdtype), mesh) for f in fulls]
                return ps, FusedAdam(ps, lr=LR, weight_decay=WD, **kwargs)

            def step(ps, opt, gs):
                for p, g in zip(ps, gs):
                    set_grad(p, g.to(torch.float32 if decoupled else pdtype), decoupled)
                opt.step()

            ps, opt = make()
            for gs in grads[:3]:
                step(ps, opt, gs)
            sd = opt.state_dict()
            _assert_state_dict_metadata(sd, ps, kwargs, 3)
            for p, (name, dt) in itertools.product(ps, (("exp_avg", kwargs.get("exp_avg_dtype")),
                                                        ("exp_avg_sq",
                                                         kwargs.get("exp_avg_sq_dtype")))):
                assert opt.state[p][name].dtype == (dt or torch.float32), (name, dt)
            ps2, opt2 = make()
            with torch.no_grad():
                for a, b in zip(ps2, ps):
                    a.copy_(b)
            opt2.load_state_dict(sd)
            for gs in grads[3:]:
                step(ps, opt, gs)
                step(ps2, opt2, gs)
            for a, b in zip(ps2, ps):
                torch.testing.assert_close(full_of(a.detach()), full_of(b.detach()))
                for name in opt.state[b]:
                    torch.testing.assert_close(full_of(opt2.state[a][name]),
                                               full_of(opt.state[b][name]))
                    assert opt2.state[a][name].dtype == opt.state[b][name].dtype
            for p, f, i in zip(ps, fulls, range(2)):
                ref, _, _ = ref_adam(f.to(pdtype).float(), [gs[i].to(pdtype).float()
                                                            if not decoupled else gs[i]
                                                            for gs in grads])
                torch.testing.assert_close(full_of(p.detach()).float(), ref.float(),
                                           rtol=2e-2, atol=2e-2)
        checks.run(f"{label} {layout}", run)

    @checks("remainders_plain")
    def remainders_plain():
        """store_param_remainders on plain bf16: master == the fp32-master run, bit for bit."""
        gen = torch.Generator().manual_seed(3)
        full = torch.randn(64, generator=gen).bfloat16()
        a, b = torch.nn.Parameter(full.clone()), torch.nn.Parameter(full.clone())
        oa = FusedAdam([a], master_weights=True, store_param_remainders=True)
        ob = FusedAdam([b], master_weights=True)
        for _ in range(5):
            g = torch.randn(64, generator=gen)
            a.grad, b.grad = g.bfloat16(), g.bfloat16()
            oa.step()
            ob.step()
        assert oa.state[a]["master_param"].dtype == torch.int16
        from npu_fsdp_patches.optim.fused_adam_step import merge_remainders
        master_a = merge_remainders(a.detach(), oa.state[a]["master_param"])
        assert torch.equal(master_a.view(torch.int32), ob.state[b]["master_param"].view(torch.int32))
        assert torch.equal(a.detach().view(torch.int16), b.detach().view(torch.int16))
        sd = oa.state_dict()
        assert sd["state"][0]["master_param"].dtype == torch.int16
    return {"checks": checks.results}
