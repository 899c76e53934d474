"""Megatron-Core's own code builds the empty-group case of tests/multirank/te_step_counter_cases.py.

What runs of Megatron-Core (0.16.1 here, 0.19.2 under Python 3.12), on gloo/CPU:

* ``_get_param_groups`` (``megatron/core/optimizer/__init__.py``) with ``get_standard_config_overrides``:
  the weight-decay and ``no_weight_decay`` groups of ``MODEL`` (a collective: every rank calls it once);
* the distributed optimizer's padded buffer layout and shard ranges: ``_ParamAndGradBuffer`` (its own
  layout in 0.16.1; in 0.19 the one ``DistributedOptimizer._compute_per_buffer_param_layout`` computes),
  then ``DistributedOptimizer._build_gbuf_range_map`` and ``_build_optimizer_group_ranges``, for each
  rank of a 1-, 2- and 3-rank data-parallel group (a stand-in group object answers ``rank()`` /
  ``size()``: these are pure index computations);
* the factory ``_get_megatron_optimizer_based_on_param_groups``, which builds TE's ``FusedAdam`` with
  Megatron's kwargs over those groups (0.19 hands it back with ``skip_megatron_wrapping=True``).

What cannot run on CPU, and what the case does instead:

* the buffer allocates on ``torch.cuda.current_device()``: it is built with that call answering
  ``"cpu"`` (only while the buffer is built);
* ``DistributedOptimizer.__init__`` stops in ``MixedPrecisionOptimizer.__init__`` at
  ``torch.tensor([0], dtype=torch.int, device='cuda')`` (0.16.1 ``optimizer.py:481``), before it shards
  anything (0.19.2 ``optimizer.py:698``), and its ``_build_model_and_main_param_groups`` accepts only
  ``torch.cuda.*Tensor`` params. So the factory's FusedAdam is taken from the factory's frame (0.16) or its
  return value (0.19) and given what that method gives it for fp32
  params: each group's ``params`` becomes the rank's slices ``model_param.view(-1)[start:end]`` (as
  leaf tensors), then ``optimizer.load_state_dict(optimizer.state_dict())`` as the constructor does
  (0.16.1 ``distrib_optimizer.py:606-608``); each group's ``weight_decay`` is set to
  ``weight_decay * wd_mult`` as Megatron's ``OptimizerParamScheduler`` does before the first step.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import os
from types import SimpleNamespace

import torch

from tests.multirank import te_step_counter_cases as cases
from tests.multirank.megatron_py312_cases import _megatron_optimizer_module


class _Group:
    """A data-parallel group as the layout code reads it: ``rank()`` and ``size()``."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def _model() -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(16, 16, bias=False), torch.nn.Linear(16, 20, bias=False),
                                torch.nn.LayerNorm(20))
    assert [(n, tuple(p.shape)) for n, p in model.named_parameters()] == list(cases.MODEL)
    return model


def _buffer(model, rank: int, world: int):
    """Megatron's distributed-optimizer buffer of ``model``'s fp32 params, as seen by ``rank`` of ``world``."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBuffer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    params = list(model.parameters())
    names = {p: n for n, p in model.named_parameters()}
    config = DistributedDataParallelConfig(use_distributed_optimizer=True)
    group, pgs = _Group(rank, world), SimpleNamespace(tp=_Group(0, 1), dp_cp=_Group(rank, world))
    current = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        if "params_with_names" in inspect.signature(_ParamAndGradBuffer.__init__).parameters:   # 0.19+
            layout = DistributedOptimizer._compute_per_buffer_param_layout(params, None, world, config)
            return _ParamAndGradBuffer(config, torch.float32, torch.float32, [(p, names[p]) for p in params],
                                       group, None, names, 1.0, list(range(len(params))), False, pgs,
                                       param_layout=layout)
        return _ParamAndGradBuffer(config, torch.float32, torch.float32, params, group, None, names, 1.0,
                                   list(range(len(params))), False, pgs)
    finally:
        torch.cuda.current_device = current


def megatron_layout(mco) -> dict:
    """Megatron's groups of ``MODEL`` and each rank's shard slices per group, at 1, 2 and 3 ranks."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    model = _model()
    names = {p: n for n, p in model.named_parameters()}
    config = mco.OptimizerConfig(optimizer="adam", lr=cases.LR, weight_decay=cases.WD, use_distributed_optimizer=True)
    # the standard overrides (no weight decay for biases and 1-D params): what get_megatron_optimizer passes in
    # 0.19 (optimizer/__init__.py:1031-1032) and what _get_param_groups applies itself for None in 0.16
    groups = mco._get_param_groups([model], config, mco.get_standard_config_overrides(config))
    layout = {}
    for world in (1, 2, 3):
        layout[world] = []
        for rank in range(world):
            ranges = [DistributedOptimizer._build_gbuf_range_map(_buffer(model, rank, world))]
            _, group_ranges = DistributedOptimizer._build_optimizer_group_ranges(groups, ranges)
            param_map = next(iter(ranges[0].values()))[0]["param_map"]
            layout[world].append([[(names[p], param_map[p]["param"].start, param_map[p]["param"].end)
                                   for p in group_range["params"]] for group_range in group_ranges])
    return {"groups": [[g["wd_mult"], [names[p] for p in g["params"]]] for g in groups], "layout": layout,
            "model": model, "param_groups": groups, "config": config}


def _factory_optimizer(mco, built: dict):
    """TE's FusedAdam as Megatron's factory builds it over the model's param groups, and where it stopped
    (None where the factory hands the inner optimizer back itself: ``skip_megatron_wrapping``, 0.18+)."""
    groups = [{**g, "params": list(g["params"])} for g in built["param_groups"]]
    factory = mco._get_megatron_optimizer_based_on_param_groups
    if "skip_megatron_wrapping" in inspect.signature(factory).parameters:
        return factory(built["config"], [built["model"]], groups, skip_megatron_wrapping=True)[0], None
    try:
        factory(built["config"], [built["model"]], groups)
    except Exception as exc:   # the DistributedOptimizer's CUDA tensor (module docstring)
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_name != "_get_megatron_optimizer_based_on_param_groups":
            tb = tb.tb_next
        assert tb is not None, f"the factory failed before it built the optimizer: {exc!r}"
        return tb.tb_frame.f_locals["optimizer"], f"{type(exc).__name__}: {exc}"
    raise AssertionError("Megatron's distributed optimizer was built on CPU: drive it directly instead")


def megatron_resume(rank: int, world: int, te_site: str, ckpt: str) -> dict:
    """The resume case of te_step_counter_cases on Megatron's own groups, layout and factory-built FusedAdam,
    on TE's own code (every patch reverted) and with the matrix's patches."""
    import npu_fsdp_patches
    mco = _megatron_optimizer_module(te_site)
    import megatron.core.package_info as info
    built = megatron_layout(mco)
    stops = []

    def make(groups):
        opt, stop = _factory_optimizer(mco, built)
        stops.append(stop)
        assert type(opt) is mco.Adam, type(opt)
        for group, mine in zip(opt.param_groups, groups):
            group["params"], group["weight_decay"] = mine["params"], mine["weight_decay"]
        opt.load_state_dict(opt.state_dict())
        return opt

    layout = {w: [[[tuple(s) for s in group] for group in r] for r in ranks] for w, ranks in built["layout"].items()}
    status = {r["name"]: r["state"] for r in npu_fsdp_patches.status()}
    npu_fsdp_patches.revert()
    unpatched = cases.resume_case(rank, world, _folder(ckpt, "te"), layout, make)
    npu_fsdp_patches.apply(*[n for n, s in status.items() if s == "applied"])
    patched = cases.resume_case(rank, world, _folder(ckpt, "patched"), layout, make)
    return {"megatron": info.__version__, "te": importlib.metadata.version("transformer_engine"), "status": status,
            "groups": built["groups"], "layout": {w: [[list(map(list, g)) for g in r] for r in ranks]
                                                  for w, ranks in layout.items()},
            "factory_stop": stops[0], "unpatched": unpatched, "patched": patched}


def _folder(root: str, name: str) -> str:
    path = os.path.join(root, name)
    os.makedirs(path, exist_ok=True)
    return path
