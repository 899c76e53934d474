"""Rank-side layout cases: every optim path on local shards, grads and states of any memory layout.

torch's fused kernels pair the elements of param, grad and states by memory position. Issue 12 saw
the local shard of an uneven ``Shard(1)`` DTensor non-contiguous on torch 2.7.1 (rank 1 of a (4, 5)
param holds (4, 2) with stride (3, 1)) next to contiguous ``zeros_like`` states. So each path runs
here on a (4, 5) ``Shard(1)`` param whose local shard is

* ``natural``: what ``distribute_tensor`` cuts on this torch;
* ``gapped``: a non-contiguous view into a wider buffer (stride (cols + 3, 1)), that layout;
* ``column_major``: dense but transposed strides;

with grads in each of those layouts, and (after the first step) states swapped for differently
strided copies. Each result is compared with the same optimizer run on plain contiguous full tensors.
"""
from __future__ import annotations

import itertools

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from npu_fsdp_patches.optim import FusedAdam, MainParamsOptimizer, foreach_adamw_step
from npu_fsdp_patches.optim.fused_adam_state import wrap_like
from npu_fsdp_patches.optim.tensors import local_tensor
from tests.multirank.dtensors import distribute_same
from tests.support import Checks

SHAPE, STEPS = (4, 5), 4
LAYOUTS = ("natural", "gapped", "column_major")


def restride(t: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values as ``t`` (2-D) in the memory layout ``layout``."""
    if layout == "natural":
        return t.clone()
    if layout == "column_major":
        return t.t().contiguous().t()
    rows, cols = t.shape
    buffer = torch.zeros(rows, cols + 3, dtype=t.dtype)
    buffer[:, :cols].copy_(t)
    return buffer[:, :cols]


def sharded(full: torch.Tensor, mesh, layout: str) -> DTensor:
    """``full`` as a Shard(1) DTensor whose local shard has ``layout``."""
    natural = distribute_same(full.clone(), mesh, [Shard(1)])
    if layout == "natural":
        return natural
    return DTensor.from_local(restride(natural.to_local(), layout), mesh, [Shard(1)],
                              run_check=False, shape=natural.shape, stride=natural.stride())


def data(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.randn(SHAPE, generator=gen)
    grads = [torch.randn(SHAPE, generator=gen) for _ in range(STEPS)]
    return p0.to(dtype), [g.to(dtype) for g in grads]


def restride_states(opt, param, names, layout: str) -> None:
    """Swap the param's state tensors for copies with ``layout`` (same values, new strides)."""
    for name in names:
        state = opt.state[param][name]
        opt.state[param][name] = wrap_like(param, restride(local_tensor(state), layout)) \
            if isinstance(param, DTensor) else restride(state, layout)


def run(make_opt, step, param_layout, grad_layout, state_layout, state_names, mesh, dtype):
    """Full tensors after STEPS steps on the DTensor layout, and on plain contiguous tensors."""
    p0, grads = data(dtype)
    out = []
    for distributed in (True, False):
        p = torch.nn.Parameter(sharded(p0, mesh, param_layout) if distributed else p0.clone())
        opt = make_opt(p)
        for i, g in enumerate(grads):
            p.grad = sharded(g, mesh, grad_layout) if distributed else g.clone()
            step(opt)
            if i == 0 and distributed:
                restride_states(opt, p, state_names, state_layout)
        states = {n: (wrap_like(p, opt.get_unscaled_state(p, n)) if isinstance(opt, FusedAdam)
                      else opt.state[p][n]) for n in state_names}   # FusedAdam: unscaled fp32
        out.append((p, states))
    (dp, dstates), (pp, pstates) = out
    return dp.full_tensor(), pp.detach(), {n: (dstates[n].full_tensor(), pstates[n]) for n in state_names}, dp


def _fused(p, **kw):
    return FusedAdam([p], lr=1e-2, weight_decay=0.1, **kw)


PATHS = {
    # name: (dtype, make_opt, step, state names)
    "FusedAdam fp32": (torch.float32, _fused, lambda o: o.step(), ("exp_avg", "exp_avg_sq")),
    "FusedAdam bf16 master": (torch.bfloat16, lambda p: _fused(p, master_weights=True),
                              lambda o: o.step(), ("exp_avg", "exp_avg_sq", "master_param")),
    "FusedAdam fp16 moments": (torch.float32, lambda p: _fused(p, exp_avg_dtype=torch.float16,
                                                              exp_avg_sq_dtype=torch.float16),
                               lambda o: o.step(), ("exp_avg", "exp_avg_sq")),
    "foreach_adamw_step": (torch.float32, lambda p: torch.optim.AdamW([p], lr=1e-2),
                           foreach_adamw_step, ("exp_avg", "exp_avg_sq")),
    "foreach_adamw_step fused group": (torch.float32,
                                       lambda p: torch.optim.AdamW([p], lr=1e-2, fused=True),
                                       foreach_adamw_step, ("exp_avg", "exp_avg_sq")),
}


def _compare(full_dist, full_plain, what, dtype, loose=False):
    """Tolerances far below the layout bug's error (1e-2); fp16 moments carry one scale per local
    shard, so their rounding differs from one scale per full tensor (``loose``)."""
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    if loose:
        tol = dict(rtol=2e-3, atol=1e-5)
    torch.testing.assert_close(full_dist.float(), full_plain.float(), **tol, msg=lambda m: f"{what}: {m}")


PATH_CASES = tuple(itertools.product(PATHS, LAYOUTS, LAYOUTS, LAYOUTS))
MAIN_PARAMS_CASES = tuple(itertools.product(LAYOUTS, LAYOUTS, (False, True)))


def _path_label(name: str, param_layout: str, grad_layout: str, state_layout: str) -> str:
    return f"{name} param={param_layout} grad={grad_layout} states={state_layout}"


def _main_params_label(param_layout: str, grad_layout: str, fused: bool) -> str:
    return f"MainParamsOptimizer(AdamW(fused={fused})) param={param_layout} grad={grad_layout}"


#: every check ``all_paths`` runs, one pytest test each
CHECKS = (*(_path_label(*case) for case in PATH_CASES),
          *(_main_params_label(*case) for case in MAIN_PARAMS_CASES))


def all_paths(rank: int, world: int) -> dict:
    """Every path x param/grad/state layout; returns the checks and the natural local strides."""
    mesh = init_device_mesh("cpu", (world,))
    checks = Checks()
    for name, *layouts in PATH_CASES:
        def path_case(name=name, layouts=layouts):
            dtype, make_opt, step, names = PATHS[name]
            dist_p, plain_p, states, dp = run(make_opt, step, *layouts, names, mesh, dtype)
            if layouts[0] == "gapped":
                assert not dp.to_local().is_contiguous(), "the gapped local shard is contiguous"
            loose = "fp16" in name
            _compare(dist_p, plain_p, "param", dtype, loose)
            for state_name, (a, b) in states.items():
                _compare(a, b, state_name, torch.float32, loose)
        checks.run(_path_label(name, *layouts), path_case)
    main_params_layouts(mesh, checks)
    natural = distribute_same(torch.zeros(SHAPE), mesh, [Shard(1)]).to_local()
    return {"checks": checks.results, "natural_local": [list(natural.shape), list(natural.stride())]}


def main_params_layouts(mesh, checks: Checks) -> None:
    """MainParamsOptimizer(AdamW) on a bf16 Shard(1) param: main params, copies and the step."""
    p0, grads = data(torch.bfloat16)
    for param_layout, grad_layout, fused in MAIN_PARAMS_CASES:
        def main_params_case(param_layout=param_layout, grad_layout=grad_layout, fused=fused):
            results = []
            for distributed in (True, False):
                model = torch.nn.Module()
                model.w = torch.nn.Parameter(sharded(p0, mesh, param_layout) if distributed
                                             else p0.clone())
                opt = MainParamsOptimizer(torch.optim.AdamW([model.w], lr=1e-2, fused=fused), model)
                for g in grads:
                    model.w.grad = sharded(g, mesh, grad_layout) if distributed else g.clone()
                    opt.step()
                    opt.zero_grad()
                main = model.w.main_param
                results.append((model.w.full_tensor() if distributed else model.w.detach(),
                                main.full_tensor() if distributed else main.detach()))
            (dist_w, dist_main), (plain_w, plain_main) = results
            _compare(dist_main, plain_main, "main_param", torch.float32)
            assert torch.equal(dist_w, dist_main.to(torch.bfloat16)), "model param != main_param.to(bf16)"
            _compare(dist_w, plain_w, "param", torch.bfloat16)
        checks.run(_main_params_label(param_layout, grad_layout, fused), main_params_case)
