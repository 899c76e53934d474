"""Rank-side code of te_initialize_state_compat on megatron-core 0.17+ (Python 3.12) with real TE.

The rank runs with a real-TE site (``tests/te_real.py``: TE's own ``fused_adam.py`` from the
registry wheel, CPU kernels) on PYTHONPATH. Megatron's own factory
``_get_megatron_optimizer_based_on_param_groups`` builds TE's FusedAdam with Megatron's kwargs and
defines ``init_state_fn``; it then stops on CPU (``FP32Optimizer.__init__`` allocates a CUDA tensor,
and where the TE CPU seam redirects that, ``ProcessGroupCollection.use_mpu_process_groups`` needs
Megatron's parallel state), so the optimizer and ``init_state_fn`` are taken from the factory's
frame, as in tests/test_megatron_initialize_state.py.

``fsdp_dtensor_main_weights``: from 0.18, ``get_megatron_optimizer`` with Megatron-FSDP gives TE
FusedAdam Megatron-FSDP's fp32 DTensor main weights and then sets ``master_weights = False`` and
``use_decoupled_grad = True`` on it (megatron-core 0.19.2 megatron/core/optimizer/__init__.py
L1115-1128). That call needs Megatron-FSDP's CUDA buffers, so those two assignments are applied
here to the factory's optimizer; ``init_state_fn`` and TE's step then run unchanged.

``megatron_fsdp_on_cpu``: Megatron-FSDP's own ``MegatronFSDP`` and ``ParamAndGradBuffer`` with
``device=cpu`` on gloo. The first stops at ``torch.cuda.current_device()`` (0.19.2 megatron_fsdp.py:234), the
second only at ``validate_uneven_dtensor``'s ``.cuda()`` (uneven_dtensor.py:187); with ``Tensor.cuda`` a no-op
for that build, its DTensor main weights and ``update_main_grads`` drive TE's real FusedAdam.
"""
from __future__ import annotations

import importlib
import sys

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import npu_fsdp_patches
from tests.multirank.fused_adam_cases import full_of, like, ref_adam

LR, WD = 1e-2, 0.1
# global shapes: uneven on 2 ranks (7 -> 4/3), 2-D, and one element (rank 1's shard is empty)
SHAPES = ((7,), (5, 3), (1,))


def _megatron_optimizer_module(te_site: str):
    """``megatron.core.optimizer`` run with TE importable (``megatron.core`` itself needs a full TE
    build, so it is imported with the site hidden, then the optimizer module is re-executed)."""
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if p != te_site]
    import megatron.core  # noqa: F401
    sys.path[:] = saved
    importlib.invalidate_caches()
    import megatron.core.optimizer as mco
    mco = importlib.reload(mco)
    assert mco.USING_PYTORCH_OPTIMIZER is False and mco.Adam.__module__.startswith("transformer_engine")
    return mco


def _factory_te_adam(mco, params):
    """TE FusedAdam and ``init_state_fn`` as Megatron's factory builds them (precision-aware config)."""
    cfg = mco.OptimizerConfig(optimizer="adam", lr=LR, weight_decay=WD, use_precision_aware_optimizer=True,
                              use_distributed_optimizer=True)
    cfg.use_distributed_optimizer = False      # after validation: the factory branch CPU can reach
    groups = [{"params": params, "wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False,
               "is_decoupled_lr": False}]
    model = torch.nn.Module()
    try:
        mco._get_megatron_optimizer_based_on_param_groups(cfg, [model], groups)
    except Exception as exc:   # no CUDA tensor / no Megatron process groups here
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_name != "_get_megatron_optimizer_based_on_param_groups":
            tb = tb.tb_next
        assert tb is not None, f"the factory failed before building the optimizer: {exc!r}"
        frame, stop = tb.tb_frame.f_locals, f"{type(exc).__name__}: {exc}"
    else:
        raise AssertionError("Megatron's optimizer was built on CPU: drive it directly instead")
    opt, init_state_fn = frame["optimizer"], frame["init_state_fn"]
    if isinstance(opt, mco.MegatronOptimizer):   # the wrapper got built (CUDA tensors redirected)
        assert opt.init_state_fn is init_state_fn
        opt = opt.optimizer
    assert type(opt) is mco.Adam and init_state_fn.__module__ == "megatron.core.optimizer", type(opt)
    return opt, init_state_fn, cfg, stop


def _patch_state() -> str:
    return {r["name"]: r["state"] for r in npu_fsdp_patches.status()}["te_initialize_state_compat"]


def factory_init_state_fn(rank: int, world: int, te_site: str) -> dict:
    """``init_state_fn_result`` on every rank."""
    return init_state_fn_result(te_site)


def init_state_fn_result(te_site: str) -> dict:
    """Megatron's ``init_state_fn(opt, config)`` on the factory's TE FusedAdam (fp32 + bf16 params).

    Needs no process group: tests/test_megatron_initialize_state.py runs it in one process.
    """
    mco = _megatron_optimizer_module(te_site)
    import megatron.core.package_info as info
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2).bfloat16())
    opt, init_state_fn, cfg, stop = _factory_te_adam(mco, list(model.parameters()))
    result = {"megatron": info.__version__, "python": sys.version_info[:2], "patch": _patch_state(),
              "master_weights": opt.master_weights, "store_param_remainders": opt.store_param_remainders,
              "factory_stop": stop}
    try:
        init_state_fn(opt, cfg)
    except TypeError as exc:
        result["error"] = str(exc)
    else:
        result["states"] = {n: {k: str(v.dtype) for k, v in opt.state[p].items()}
                            for n, p in model.named_parameters()}
    return result


def fsdp_dtensor_main_weights(rank: int, world: int, te_site: str, steps: int = 3) -> dict:
    """Megatron-FSDP's fp32 DTensor main weights with decoupled grads through TE's real FusedAdam."""
    mco = _megatron_optimizer_module(te_site)
    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(7)
    fulls = [torch.randn(shape, generator=gen) for shape in SHAPES]
    params = [torch.nn.Parameter(distribute_tensor(f.clone(), mesh, (Shard(0),), src_data_rank=None))
              for f in fulls]
    opt, init_state_fn, cfg, _ = _factory_te_adam(mco, params)
    built = {"master_weights": opt.master_weights, "use_decoupled_grad": opt.use_decoupled_grad}
    opt.master_weights = False           # megatron/core/optimizer/__init__.py L1115-1128 (0.19.2)
    opt.use_decoupled_grad = True
    result = {"patch": _patch_state(), "built": built}
    try:
        init_state_fn(opt, cfg)
    except TypeError as exc:
        result["error"] = str(exc)
        return result
    result["state_layout"] = {
        i: {k: (type(v).__name__, tuple(v.shape), tuple(v.to_local().shape) if isinstance(v, DTensor) else None,
                str(v.dtype)) for k, v in opt.state[p].items()}
        for i, p in enumerate(params)}
    grads = [[torch.randn(shape, generator=gen) for shape in SHAPES] for _ in range(steps)]
    for step in range(steps):
        for p, g in zip(params, grads[step]):
            p.decoupled_grad = like(p, g)
            p.grad = None
        opt.step()
    diffs = []
    for i, (p, f) in enumerate(zip(params, fulls)):
        want = ref_adam(f, [g[i] for g in grads], lr=LR, wd=WD)[0].float()
        got = full_of(p.detach())
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (i, (got - want).abs().max().item())
        diffs.append((got - want).abs().max().item())
    result["max_diff"] = max(diffs)
    result["local_rows"] = [int(p.to_local().shape[0]) for p in params]
    return result


def _failure(exc: BaseException) -> dict:
    """The exception and the innermost megatron frame (file:line) it came from."""
    import traceback
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/megatron/core/" in f.filename]
    where = f"{frames[-1].filename.split('site-packages/')[-1]}:{frames[-1].lineno}" if frames else None
    return {"error": f"{type(exc).__name__}: {exc}"[:400], "where": where}


def megatron_fsdp_on_cpu(rank: int, world: int, te_site: str) -> dict:
    """Megatron-FSDP's own classes on gloo/CPU with TE's real FusedAdam: how far each one gets.

    ``MegatronFSDP`` (the module wrapper) and ``ParamAndGradBuffer`` (the buffers that make the optimizer's
    DTensor main weights) are built with ``device=cpu`` on a ``(dp_shard, tp)`` mesh; where one builds, its
    ``optimizer_named_parameters`` go to TE FusedAdam built and flipped as Megatron-Core does.
    """
    mco = _megatron_optimizer_module(te_site)
    from megatron.core.distributed.fsdp.src.megatron_fsdp import megatron_fsdp as mf
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as pgb
    from megatron.core.distributed.fsdp.src.megatron_fsdp import utils
    from megatron.core.distributed.fsdp.src.megatron_fsdp.distributed_data_parallel_config import (
        DistributedDataParallelConfig)
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp_shard", "tp"))
    index = utils.FSDPDistributedIndex(device_mesh=mesh, dp_shard_dim="dp_shard", tp_dim="tp")
    out = {}
    buffer = lambda m: pgb.ParamAndGradBuffer(  # noqa: E731
        DistributedDataParallelConfig(data_parallel_sharding_strategy="optim_grads_params",
                                      megatron_fsdp_use_decoupled_grad=True),
        m, pgb.BucketingPolicy(data_parallel_sharding_strategy="optim_grads_params"), index,
        device=torch.device("cpu"))
    for name, build in (
            ("MegatronFSDP", lambda m: mf.MegatronFSDP(m, dist_index=index, device=torch.device("cpu"))),
            ("ParamAndGradBuffer", buffer), ("ParamAndGradBuffer, .cuda() a no-op", _no_cuda(buffer))):
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        try:
            built = build(model)
        except Exception as exc:  # reported: what blocks Megatron-FSDP on CPU
            out[name] = _failure(exc)
            continue
        params = getattr(built, "optimizer_named_parameters", None)
        out[name] = {"built": True, "params": [(n, type(p).__name__, tuple(p.shape)) for n, p in params or []]}
        if params:
            out[name].update(_te_steps_on_buffer(built, mco, rank))
    return out


def _te_steps_on_buffer(buf, mco, rank: int, steps: int = 2) -> dict:
    """TE FusedAdam over the buffer's DTensor main weights, built and flipped as Megatron-Core 0.18+ does
    (optimizer/__init__.py:562-584, :1087-1089), fed by ``update_main_grads``; vs float64 AdamW per shard."""
    params = [p for _, p in buf.optimizer_named_parameters]
    opt = mco.Adam(params, lr=LR, weight_decay=WD, adam_w_mode=True, master_weights=True,
                   use_decoupled_grad=True, master_weight_dtype=torch.float32, store_param_remainders=True,
                   exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32)
    opt.master_weights, opt.use_decoupled_grad = False, True
    start = [p._local_tensor.detach().clone() for p in params]
    gen = torch.Generator().manual_seed(11 + rank)
    grads = [[] for _ in params]
    for _ in range(steps):
        for group in buf.parameter_groups:
            if group.main_grad_buffer is not None:
                data = group.main_grad_buffer.data
                data.copy_(torch.randn(data.shape, generator=gen))
        buf.update_main_grads()
        for i, p in enumerate(params):
            g = getattr(p, "decoupled_grad", None)
            grads[i].append(None if g is None else g._local_tensor.detach().clone())
        opt.step()
    errs = [float((p._local_tensor.detach().double()
                   - ref_adam(s, g, lr=LR, wd=WD, betas=(0.9, 0.999), eps=1e-8)[0]).abs().max())
            for p, s, g in zip(params, start, grads) if s.numel()]
    return {"local_numels": [p._local_tensor.numel() for p in params], "max_err": max(errs),
            "none_grads_on_empty": all(all(x is None for x in g) for p, g in zip(params, grads)
                                       if not p._local_tensor.numel()),
            "states": sorted({k for p in params for k in opt.state[p]}), "patch_states": _patch_states()}


def _patch_states() -> dict:
    return {r["name"]: r["state"] for r in npu_fsdp_patches.status() if r["name"].startswith("te_")}


def _no_cuda(build):
    """``build`` with ``Tensor.cuda`` returning the tensor itself (a CPU seam for probing only)."""
    def run(model):
        saved = torch.Tensor.cuda
        torch.Tensor.cuda = lambda self, *a, **k: self
        try:
            return build(model)
        finally:
            torch.Tensor.cuda = saved
    return run
