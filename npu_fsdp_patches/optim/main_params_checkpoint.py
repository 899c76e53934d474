"""DCP save/load of a model plus a :class:`MainParamsOptimizer`, with checks before loading
(docs/main_params.md, docs/hyper_parallel.md#rfc-001-9-checkpoints).

The checkpoint is what torch's own API writes, one ``torch.distributed.checkpoint`` save of
``{"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}``::

    model.<fqn>                                   model tensors
    optimizer.state.<fqn>.<name>                  optimizer state by FQN
    optimizer.state.<fqn>.main_param              fp32 main param (bf16/fp16 params only)
    optimizer.param_groups                        param groups

so a checkpoint written here loads with torch's API (``dcp.load`` + ``set_state_dict``) and the
reverse. ``load_checkpoint`` reads the checkpoint metadata *first* and picks a branch: all main
params present -> restored exactly; none -> a plain optimizer's checkpoint, main params rebuilt from
the model with a warning; some -> raise before anything is written. Checkpoints of the earlier
layout (main params under ``optimizer._mixed_precision_optimizer.fp32_from_fp16_params.<fqn>``)
load the same way. DTensor entries are resharded by DCP, so a checkpoint loads at another world size.

Only plain tensors and torch DTensors: DCP does not know hyper-parallel DTensors (their ops fail
outside ``SkipDTensorDispatch``; inside it DCP sees only local shards and would save each as the
whole tensor), so models holding them are refused up front; their
``MainParamsOptimizer.state_dict()`` goes through hyper-parallel's own checkpointer.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import torch

import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from ._leaf_views import MAIN_PARAM
from ._main_params_state import (MAIN_PARAMS_KEY, MP_KEY, drop_main_params, raise_partial_main_params,
                                 upgrade_legacy)
from ._rollback import Rollback
from .main_params import MainParamsOptimizer
from .tensors import is_foreign_dtensor

__all__ = ["save_checkpoint", "load_checkpoint"]

_LEGACY_PREFIX = f"optimizer.{MP_KEY}.{MAIN_PARAMS_KEY}."


#: hyper-parallel's own checkpoint module: core/checkpoint in the public source (fdd0a808), renamed
#: core/distributed_checkpoint by later builds (docs/hyper_parallel.md#17-dcp-checkpointer)
_HYPER_CHECKPOINTERS = ("hyper_parallel.core.distributed_checkpoint", "hyper_parallel.core.checkpoint")


def _hyper_checkpointer() -> str:
    """The checkpoint module the installed hyper-parallel has, found without importing it."""
    import importlib.util
    for name in _HYPER_CHECKPOINTERS:
        try:
            if importlib.util.find_spec(name) is not None:
                return name
        except (ImportError, ValueError):
            continue
    return (f"{_HYPER_CHECKPOINTERS[1]} in the public source, {_HYPER_CHECKPOINTERS[0]} in later builds; "
            "this hyper_parallel has neither")


def _refuse_foreign_dtensors(model: nn.Module) -> None:
    for fqn, p in model.named_parameters():
        if is_foreign_dtensor(p):
            cls = type(p)
            raise TypeError(
                f"parameter {fqn!r} is a {cls.__module__}.{cls.__name__}, which "
                f"torch.distributed.checkpoint does not understand (it sees only the local shard). "
                f"Save the model and MainParamsOptimizer.state_dict() with "
                f"hyper-parallel's own checkpointer ({_hyper_checkpointer()}).")


def save_checkpoint(checkpoint_id: str | os.PathLike, model: nn.Module, optimizer: Any) -> None:
    """Write model and optimizer state (with the fp32 main params) in one DCP save, in the layout
    of torch's ``get_model_state_dict``/``get_optimizer_state_dict``.

    ``optimizer`` is a :class:`MainParamsOptimizer`, or any torch optimizer (or list of them) for
    a plain optimizer checkpoint in the same layout.
    """
    _refuse_foreign_dtensors(model)
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.save(state, checkpoint_id=checkpoint_id)


def _saved_keys(checkpoint_id: str | os.PathLike) -> set[str]:
    reader = dcp.FileSystemReader(os.fspath(checkpoint_id))
    return set(reader.read_metadata().state_dict_metadata)


def _has(keys: set[str], prefix: str) -> bool:
    return any(k == prefix or k.startswith(prefix + ".") for k in keys)


def _main_params_branch(keys: set[str], optimizer: MainParamsOptimizer) -> tuple[str, bool]:
    """(``"main_params"`` or ``"plain"``, legacy layout?) from the checkpoint metadata; raises when
    only some main params are saved."""
    expected = list(optimizer.main_params_by_fqn())
    new = [f for f in expected if f"optimizer.state.{f}.{MAIN_PARAM}" in keys]
    legacy = [f for f in expected if _has(keys, _LEGACY_PREFIX + f)]
    present = new or legacy
    if (present and len(present) < len(expected)) or (not present and expected
                                                      and _has(keys, f"optimizer.{MP_KEY}")):
        raise_partial_main_params(f for f in expected if f not in present)
    return ("main_params" if present or not expected else "plain"), bool(legacy)


def _template(keys: set[str], osd: dict, branch: str, legacy: bool) -> dict:
    """The optimizer state dict DCP loads into: only what the checkpoint has, in its layout."""
    if branch == "plain" or legacy:
        mains = {fqn: state[MAIN_PARAM] for fqn, state in osd["state"].items() if MAIN_PARAM in state}
        osd = drop_main_params(osd)
        if legacy:
            osd[MP_KEY] = {MAIN_PARAMS_KEY: mains}
    for fqn in list(osd["state"]):   # saved while still lazy: no state for this param
        osd["state"][fqn] = {k: v for k, v in osd["state"][fqn].items()
                             if _has(keys, f"optimizer.state.{fqn}.{k}")}
        if not osd["state"][fqn]:
            del osd["state"][fqn]
    return osd


def _add_saved_fp32_masters(keys: set[str], osd: dict, model: nn.Module) -> None:
    """Ask DCP for the fp32 main params the checkpoint holds for params that are fp32 here (a
    bf16/fp16 model's checkpoint into an fp32 model): the wrapper resumes the fp32 params from
    them rather than from the bf16-rounded model weights (no silent precision loss)."""
    params = dict(model.named_parameters())
    for fqn, state in list(osd["state"].items()):
        p = params.get(fqn)
        if (p is not None and p.dtype == torch.float32 and MAIN_PARAM not in state
                and f"optimizer.state.{fqn}.{MAIN_PARAM}" in keys):
            # a new dict: torch may hand out the leaf's own per-param state dicts
            osd["state"][fqn] = {**state, MAIN_PARAM: torch.empty_like(p.detach(), dtype=torch.float32)}


def load_checkpoint(checkpoint_id: str | os.PathLike, model: nn.Module,
                    optimizer: Any = None, *, load_optimizer: bool = True) -> str:
    """Load a checkpoint of :func:`save_checkpoint`, of torch's API, or of the earlier layout.

    Returns the branch taken: ``"main_params"``, ``"plain"`` (main params rebuilt from the model,
    with a warning), ``"model_only"`` (``load_optimizer=False``: model loaded, then
    ``reload_model_params``) or ``"plain_optimizer"`` (``optimizer`` is no MainParamsOptimizer:
    saved main params are not loaded). Every check runs on the checkpoint metadata before anything
    is written into ``model`` or ``optimizer``.
    """
    _refuse_foreign_dtensors(model)
    keys = _saved_keys(checkpoint_id)
    msd = get_model_state_dict(model)
    missing_model = sorted(k for k in msd if not _has(keys, f"model.{k}"))
    if missing_model:
        raise ValueError(f"checkpoint {os.fspath(checkpoint_id)!r} lacks model entries: "
                         f"{', '.join(missing_model)}")
    if not load_optimizer or optimizer is None:
        state = {"model": _fresh(msd)}
        dcp.load(state, checkpoint_id=checkpoint_id)
        with _restored_on_failure(model, optimizer):
            set_model_state_dict(model, state["model"])
            if isinstance(optimizer, MainParamsOptimizer):
                optimizer.reload_model_params()
        return "model_only"
    if not _has(keys, "optimizer"):
        raise ValueError(f"checkpoint {os.fspath(checkpoint_id)!r} has no optimizer state; "
                         f"pass load_optimizer=False to load the model only")
    if isinstance(optimizer, MainParamsOptimizer):
        branch, legacy = _main_params_branch(keys, optimizer)
    else:
        branch, legacy = "plain_optimizer", False
    osd = get_optimizer_state_dict(model, optimizer)
    if isinstance(optimizer, MainParamsOptimizer) and not legacy:
        _add_saved_fp32_masters(keys, osd, model)
    osd = _template(keys, osd, branch, legacy)
    state = {"model": _fresh(msd), "optimizer": _fresh(osd)}
    dcp.load(state, checkpoint_id=checkpoint_id)
    if legacy:
        state["optimizer"] = upgrade_legacy(state["optimizer"])
    with _restored_on_failure(model, optimizer):
        # the model first (torch's set_state_dict loads the optimizer first): main params rebuilt
        # from the model ("plain") must see the loaded model
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=False))
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=StateDictOptions(strict=False))
    return branch


def _fresh(tree: Any) -> Any:
    """``tree`` with every tensor replaced by a new one of the same layout (DTensors stay DTensors,
    local op, no collective): DCP loads into these, never into the live model and optimizer, so a
    failed or partial read changes nothing (docs/design.md#validate-then-commit). This costs a
    second copy of the loaded state until the call returns."""
    if isinstance(tree, torch.Tensor):
        return torch.empty_like(tree)
    if isinstance(tree, dict):
        return {k: _fresh(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_fresh(v) for v in tree]
    return tree


@contextlib.contextmanager
def _restored_on_failure(model: nn.Module, optimizer: Any) -> Iterator[None]:
    """Undo a commit that fails midway: the model's tensors (cloned first) and, for a
    :class:`MainParamsOptimizer`, its leaf optimizers and main params. (A wrapper's own
    ``load_state_dict`` already rolls itself back; the model loads first, so it needs this.)"""
    rollback = Rollback()
    for t in [*model.parameters(), *model.buffers()]:
        rollback.tensor(t)
    if isinstance(optimizer, MainParamsOptimizer):
        for leaf in optimizer.leaf_optimizers:
            rollback.optimizer(leaf)
        for _, main in optimizer.main_params_by_fqn().items():
            rollback.tensor(main)
        rollback.attrs(optimizer)
    else:
        for leaf in ([optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)):
            rollback.optimizer(leaf)
    try:
        yield
    except BaseException:
        rollback.restore()
        raise
