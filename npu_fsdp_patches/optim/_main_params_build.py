"""Building a main-params wrapper: its leaf optimizers, the fp32 main params swapped into their
groups, and the leaves' own caches of param identity brought up to date after the swap.

Kept apart from :mod:`.main_params` (the wrapper's step and state dict) because it runs once, at
construction, and decides which params get a main param: bf16/fp16 ones get an fp32 copy; every
other dtype (fp32, float64, complex) is its own main param, as a plain optimizer steps it. An optimizer
that already keeps fp32 masters of its own (a main-params wrapper, or a leaf with master weights) is
refused before anything is written: a second fp32 copy would cost 4 B per element and the two copies
would drift apart.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ._leaf_views import MAIN_PARAM
from ._main_param_tensors import fp32_main_param
from ._param_identity import stale_param_references
from ._rollback import Rollback

#: the dtypes that get an fp32 main param; every other dtype is its own main param
LOW_PRECISION = (torch.float16, torch.bfloat16)


def leaf_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The leaf optimizers behind ``optimizer``: one optimizer, a list/dict, or a chained optimizer.

    Chained optimizers are recognised by their ``chained_optimizers`` list or their
    ``optimizers_dict`` mapping (docs/hyper_parallel.md#14-optimizers). One that keeps fp32 masters of
    its own (:func:`fp32_masters_kept_by`) is refused with the reason, before anything is written.
    """
    _refuse_fp32_masters(optimizer)
    if isinstance(optimizer, dict):
        children = list(optimizer.values())
    elif isinstance(optimizer, (list, tuple)):
        children = list(optimizer)
    elif getattr(optimizer, "chained_optimizers", None) is not None:
        children = list(optimizer.chained_optimizers)
    elif getattr(optimizer, "optimizers_dict", None) is not None:
        children = list(optimizer.optimizers_dict.values())
    elif isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    else:
        raise TypeError(f"expected a torch optimizer, a list/dict of optimizers or a chained "
                        f"optimizer, got {type(optimizer).__name__}")
    leaves = [leaf for child in children for leaf in leaf_optimizers(child)]
    if not leaves:
        raise ValueError("the chained optimizer holds no optimizers")
    return leaves


def fp32_masters_kept_by(optimizer: Any) -> str | None:
    """Why ``optimizer`` already keeps fp32 masters of its own, judged by what it has, or None.

    * a main-params wrapper: ``fp32_from_float16_groups`` (MainParamsOptimizer, Megatron's and
      hyper-parallel's ``Float16OptimizerWithFloat16Params``);
    * ``master_weights`` set (Transformer Engine's and our ``FusedAdam``);
    * a per-param state already holding a master copy (``master_param``, veomni's ``master_weight``,
      ``main_param``) once it stepped;
    * before its first step, a class in its MRO named for master weights (veomni's ``MasterFP32AdamW``
      and its subclasses ``FullFP32AdamW``, ``CPUOffloadAdamW``), unless ``master_weights`` says no.
    """
    if getattr(optimizer, "fp32_from_float16_groups", None) is not None:
        return (f"it already is a main-params wrapper ({type(optimizer).__name__} has "
                f"fp32_from_float16_groups): its params already have fp32 main params")
    if not isinstance(optimizer, torch.optim.Optimizer):
        return None
    flag = getattr(optimizer, "master_weights", None)
    if flag:
        return f"it keeps fp32 master weights itself (master_weights={flag!r})"
    for entry in list(vars(optimizer).get("state", {}).values()):
        for key, value in (entry.items() if isinstance(entry, dict) else ()):
            if isinstance(key, str) and ("master" in key.lower() or key == MAIN_PARAM) \
                    and isinstance(value, torch.Tensor):
                return f"its state already holds master copies of its params ({key!r})"
    if flag is None:
        named = next((cls.__name__ for cls in type(optimizer).__mro__ if "master" in cls.__name__.lower()), None)
        if named is not None:
            return f"its class {type(optimizer).__name__} keeps fp32 master weights (it is a {named})"
    return None


def _refuse_fp32_masters(optimizer: Any) -> None:
    reason = fp32_masters_kept_by(optimizer)
    if reason is not None:
        raise TypeError(
            f"MainParamsOptimizer cannot wrap {type(optimizer).__module__}.{type(optimizer).__name__}: "
            f"{reason}. A second fp32 copy would cost 4 B per element more, and the two copies would "
            f"drift apart. Nothing was changed. "
            + ("Use that wrapper as it is: it already is the optimizer over the model params."
               if "wrapper" in reason else
               "Use that optimizer as it is, or build it without master weights and let "
               "MainParamsOptimizer keep the fp32 main params."))


def check_params(leaves: list[torch.optim.Optimizer], fqn_by_id: dict[int, str]) -> None:
    """Every check of the wrap, run before the first swap (validate, then commit: a refusal leaves
    the optimizer as it was): each param is a model param and in one group only. A param repeated
    within one group is taken as torch takes it (its leaf warned when the group was made): it keeps
    one main param."""
    seen: set[int] = set()
    for leaf in leaves:
        for g, group in enumerate(leaf.param_groups):
            in_group: set[int] = set()
            for i, p in enumerate(group["params"]):
                fqn = fqn_by_id.get(id(p))
                if fqn is None:
                    raise ValueError(f"param {i} of group {g} of {type(leaf).__name__} is not a parameter "
                                     f"of the model, so it has no FQN")
                if id(p) in seen and id(p) not in in_group:
                    raise ValueError(f"parameter {fqn!r} appears in more than one param group")
                seen.add(id(p))
                in_group.add(id(p))


def check_new_group(leaves: list[torch.optim.Optimizer], param_group: Any, model: nn.Module,
                    wrapped: set[int], owner: str) -> tuple[list, dict[int, str]]:
    """The checks of ``add_param_group`` on a wrapper, before its first write, in torch's order and
    wording where torch checks the same: one leaf to take the group, a dict, ordered params (a tensor, a
    list, named ``(name, param)`` pairs), each a model param in no group yet. Returns the group's params
    as a list and the model's ``{id(param): fqn}``."""
    if len(leaves) != 1:
        raise ValueError(f"{owner}.add_param_group: the wrapper steps {len(leaves)} leaf optimizers and cannot "
                         f"tell which one takes the new group; add it to that leaf optimizer before wrapping")
    if not isinstance(param_group, dict):
        raise TypeError(f"param_group must be a dict, but got {type(param_group).__name__}")
    params = param_group.get("params")
    if isinstance(params, torch.Tensor):
        params = [params]
    elif isinstance(params, set) or params is None:
        raise TypeError("optimizer parameters need to be organized in ordered collections, but the "
                        "ordering of tensors in sets will change between runs. Please use a list instead.")
    params = list(params)
    fqn_by_id: dict[int, str] = {}
    for name, p in model.named_parameters():
        fqn_by_id.setdefault(id(p), name)
    for i, x in enumerate(params):
        p = x[1] if isinstance(x, tuple) and len(x) == 2 else x
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"optimizer can only optimize Tensors, but one of the params is {torch.typename(p)}")
        if id(p) not in fqn_by_id:
            raise ValueError(f"param {i} of the new group is not a parameter of the model, so it has no FQN")
        if id(p) in wrapped:
            raise ValueError(f"some parameters appear in more than one parameter group "
                             f"({fqn_by_id[id(p)]!r} is already in one)")
    return params, fqn_by_id


def main_params_for(params: list, fqn_by_id: dict[int, str]) -> tuple[list, list, list, list, list]:
    """What a leaf steps for one group's ``params``: each bf16/fp16 param replaced by a new fp32 main
    param (a param repeated in the group keeps one); every other param is its own (fp32, float64,
    complex: stepped as a plain optimizer steps it). Writes nothing. Returns ``(stepped, float16,
    fp32_from_float16, fp32_from_fp32, [(param, fqn), ...])``, the last four without repeats."""
    stepped, float16, fp32_from_float16, fp32_from_fp32, fqns = [], [], [], [], []
    mains: dict[int, nn.Parameter] = {}
    for p in params:
        if id(p) not in mains:
            if p.dtype in LOW_PRECISION:
                mains[id(p)] = fp32_main_param(p)
                float16.append(p)
                fp32_from_float16.append(mains[id(p)])
            else:
                mains[id(p)] = p
                fp32_from_fp32.append(p)
            fqns.append((p, fqn_by_id[id(p)]))
        stepped.append(mains[id(p)])
    return stepped, float16, fp32_from_float16, fp32_from_fp32, fqns


def swap_in_main_params(leaf: torch.optim.Optimizer, g: int, group: dict,
                        fqn_by_id: dict[int, str]) -> tuple[list, list, list, list]:
    """Put an fp32 main param in place of each bf16/fp16 param of ``leaf``'s group ``g`` (its state
    moves with it). Returns ``(float16, fp32_from_float16, fp32_from_fp32, [(param, fqn), ...])``.
    The params were checked by :func:`check_params`; the caller recorded ``leaf`` in a
    :class:`~._rollback.Rollback` first, so a later failure puts everything back."""
    stepped, float16, fp32_from_float16, fp32_from_fp32, fqns = main_params_for(group["params"], fqn_by_id)
    for i, main in enumerate(stepped):
        if main is not group["params"][i]:
            group["params"][i] = main
    for p, main in zip(float16, fp32_from_float16):
        if p in leaf.state:
            leaf.state[main] = _state_for_main_param(leaf.state.pop(p))
    return float16, fp32_from_float16, fp32_from_fp32, fqns


def _state_for_main_param(entry: Any) -> Any:
    """A bf16/fp16 param's state, moved to its fp32 main param: its low-precision moments cast to fp32, as
    torch's ``Optimizer.load_state_dict`` casts floating state to the param's dtype (``step`` kept as is).
    A leaf that stepped before the wrap would otherwise update fp32 params with bf16 moments, which torch's
    kernels refuse. A new dict: the original stays intact for the rollback."""
    if not isinstance(entry, dict):
        return entry
    return {key: (value.to(torch.float32)
                  if key != "step" and isinstance(value, torch.Tensor) and value.dtype in LOW_PRECISION else value)
            for key, value in entry.items()}


def record_wrap(rollback: Rollback, optimizer: Any, leaves: list[torch.optim.Optimizer],
                model: nn.Module) -> None:
    """Record everything a wrap writes: the leaves (groups, state, attributes their
    ``reset_optimizer_parameters`` may reassign), a chained optimizer's attributes, and the model
    params' attributes (``main_param``)."""
    for leaf in leaves:
        rollback.optimizer(leaf)
    if optimizer not in leaves and hasattr(optimizer, "__dict__") and not isinstance(optimizer, (list, dict)):
        rollback.attrs(optimizer)
    for p in model.parameters():
        rollback.attrs(p)


def reset_param_caches(optimizer: Any, leaves: list[torch.optim.Optimizer],
                       model_of_main: dict[nn.Parameter, nn.Parameter], swapped: dict[int, str]) -> None:
    """Let optimizers that cache param identity see the main params, or refuse them.

    A chained ``optimizer`` with ``reset_optimizer_parameters(mapping)`` gets the main-param ->
    model-param mapping; otherwise each leaf that has ``reset_optimizer_parameters()`` rebuilds
    itself. Then every leaf's attributes other than ``state``/``param_groups`` are searched for the
    swapped-out params (``swapped``: id -> FQN) or their ``id()``: a leaf still holding one is
    refused, since it would keep using them. Optimizers that key only ``state`` by param pass
    whatever their name.
    """
    reset = getattr(optimizer, "reset_optimizer_parameters", None)
    if reset is not None and optimizer not in leaves:
        reset(model_of_main)
    else:
        for leaf in leaves:
            if callable(getattr(leaf, "reset_optimizer_parameters", None)):
                leaf.reset_optimizer_parameters()
    for leaf in leaves:
        stale = stale_param_references(leaf, swapped) if swapped else []
        if stale:
            raise TypeError(
                f"{type(leaf).__module__}.{type(leaf).__name__} keeps references to "
                f"low-precision params outside its state and param_groups ({'; '.join(stale)}), "
                f"and after the swap to fp32 main params they would still point at the "
                f"low-precision params. Give it a reset_optimizer_parameters() that rebuilds "
                f"them from param_groups, or build it so that it keys only `state` by param "
                f"(as torch.optim.Muon does).")
