"""Building a main-params wrapper: its leaf optimizers, the fp32 main params swapped into their
groups, and the leaves' own caches of param identity brought up to date after the swap.

Kept apart from :mod:`.main_params` (the wrapper's step and state dict) because it runs once, at
construction, and decides which params get a main param: bf16/fp16 ones get an fp32 copy, fp32 ones
are their own, any other dtype is refused.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ._main_param_tensors import fp32_main_param
from ._param_identity import stale_param_references
from ._rollback import Rollback

LOW_PRECISION = (torch.float16, torch.bfloat16)


def leaf_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The leaf optimizers behind ``optimizer``: one optimizer, a list/dict, or a chained optimizer.

    Chained optimizers are recognised by their ``chained_optimizers`` list or their
    ``optimizers_dict`` mapping (docs/hyper_parallel.md#14-optimizers).
    """
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


def check_params(leaves: list[torch.optim.Optimizer], fqn_by_id: dict[int, str]) -> None:
    """Every check of the wrap, run before the first swap (validate, then commit: a refusal leaves
    the optimizer as it was): each param is a model param, in one group only, of a supported dtype."""
    seen: set[int] = set()
    for leaf in leaves:
        for g, group in enumerate(leaf.param_groups):
            for i, p in enumerate(group["params"]):
                fqn = fqn_by_id.get(id(p))
                if fqn is None:
                    raise ValueError(f"param {i} of group {g} of {type(leaf).__name__} is not a parameter "
                                     f"of the model, so it has no FQN")
                if id(p) in seen:
                    raise ValueError(f"parameter {fqn!r} appears in more than one param group")
                if p.dtype not in LOW_PRECISION and p.dtype != torch.float32:
                    raise TypeError(f"parameter {fqn!r} has dtype {p.dtype}; MainParamsOptimizer "
                                    f"supports float16, bfloat16 and float32 params only")
                seen.add(id(p))


def swap_in_main_params(leaf: torch.optim.Optimizer, g: int, group: dict,
                        fqn_by_id: dict[int, str]) -> tuple[list, list, list, list]:
    """Put an fp32 main param in place of each bf16/fp16 param of ``leaf``'s group ``g`` (its state
    moves with it). Returns ``(float16, fp32_from_float16, fp32_from_fp32, [(param, fqn), ...])``.
    The params were checked by :func:`check_params`; the caller recorded ``leaf`` in a
    :class:`~._rollback.Rollback` first, so a later failure puts everything back."""
    float16, fp32_from_float16, fp32_from_fp32, fqns = [], [], [], []
    for i, p in enumerate(group["params"]):
        fqn = fqn_by_id[id(p)]
        if p.dtype in LOW_PRECISION:
            main = fp32_main_param(p)
            group["params"][i] = main
            if p in leaf.state:
                leaf.state[main] = leaf.state.pop(p)
            float16.append(p)
            fp32_from_float16.append(main)
        else:
            fp32_from_fp32.append(p)
        fqns.append((p, fqn))
    return float16, fp32_from_float16, fp32_from_fp32, fqns


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
