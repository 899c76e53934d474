"""DCP save/load of a model plus a :class:`MainParamsOptimizer` (docs/hyper_parallel.md#rfc-001-9-checkpoints).

Checkpoint layout (one ``torch.distributed.checkpoint`` save)::

    model.<fqn>                                                      model tensors
    optimizer.state.<fqn>.<name>, optimizer.param_groups             leaf-optimizer state by FQN
    optimizer._mixed_precision_optimizer.fp32_from_fp16_params.<fqn> fp32 main params (bf16/fp16 only)

``load_checkpoint`` reads the checkpoint metadata *first* and picks a branch
(docs/hyper_parallel.md#rfc-001-9-checkpoints): all main params present -> restore them exactly; section
absent -> plain optimizer checkpoint, main params rebuilt from the model with a warning; some missing -> raise
before anything is written. DTensor entries are resharded by DCP, so a checkpoint loads at another world size.

Only plain tensors and torch DTensors: DCP does not know hyper-parallel DTensors (their ops fail
outside ``SkipDTensorDispatch``; inside it DCP sees only local shards and would save each as the
whole tensor), so models holding them are refused up front; their
``MainParamsOptimizer.state_dict()`` goes through hyper-parallel's own checkpointer.
"""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from .tensors import is_foreign_dtensor
from .main_params import MAIN_PARAMS_KEY, MP_KEY, MainParamsOptimizer, raise_partial_main_params

__all__ = ["save_checkpoint", "load_checkpoint"]

_MAIN_PREFIX = f"optimizer.{MP_KEY}.{MAIN_PARAMS_KEY}."


def _optimizer_state_dict(model: nn.Module, optimizer: Any) -> dict:
    if isinstance(optimizer, MainParamsOptimizer):
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    return get_optimizer_state_dict(model, optimizer)   # same FQN layout, no main params


def _refuse_foreign_dtensors(model: nn.Module) -> None:
    for fqn, p in model.named_parameters():
        if is_foreign_dtensor(p):
            cls = type(p)
            raise TypeError(
                f"parameter {fqn!r} is a {cls.__module__}.{cls.__name__}, which "
                f"torch.distributed.checkpoint does not understand (it sees only the local shard). "
                f"Save the model and MainParamsOptimizer.state_dict() with "
                f"hyper-parallel's own checkpointer (hyper_parallel.core.distributed_checkpoint).")


def save_checkpoint(checkpoint_id: str | os.PathLike, model: nn.Module, optimizer: Any) -> None:
    """Write model, leaf-optimizer state and fp32 main params with one DCP save.

    ``optimizer`` is a :class:`MainParamsOptimizer`, or any torch optimizer (list) for a plain
    optimizer checkpoint in the same FQN layout.
    """
    _refuse_foreign_dtensors(model)
    state = {"model": model.state_dict(), "optimizer": _optimizer_state_dict(model, optimizer)}
    dcp.save(state, checkpoint_id=checkpoint_id)


def _saved_keys(checkpoint_id: str | os.PathLike) -> set[str]:
    reader = dcp.FileSystemReader(os.fspath(checkpoint_id))
    return set(reader.read_metadata().state_dict_metadata)


def _has(keys: set[str], prefix: str) -> bool:
    return any(k == prefix or k.startswith(prefix + ".") for k in keys)


@torch.no_grad()
def _prime_optimizer_state(optimizer: MainParamsOptimizer) -> None:
    """Create the lazy leaf-optimizer state DCP must load into (docs/hyper_parallel.md#rfc-001-9-checkpoints).

    Params without state get a zero grad and take one step at lr=0 and weight_decay=0, which
    creates their state without changing any param; params that already have state are skipped.
    """
    for leaf in optimizer.leaf_optimizers:
        saved = []
        for group in leaf.param_groups:
            saved.append({k: group[k] for k in ("lr", "weight_decay") if k in group})
            for k in saved[-1]:
                group[k] = torch.zeros_like(group[k]) if torch.is_tensor(group[k]) else 0.0
            for p in group["params"]:
                if p not in leaf.state or not leaf.state[p]:
                    p.grad = torch.zeros_like(p)
        if any(p.grad is not None for g in leaf.param_groups for p in g["params"]):
            leaf.step()
        for group, values in zip(leaf.param_groups, saved):
            group.update(values)
            for p in group["params"]:
                p.grad = None


def load_checkpoint(checkpoint_id: str | os.PathLike, model: nn.Module,
                    optimizer: MainParamsOptimizer | None = None, *,
                    load_optimizer: bool = True) -> str:
    """Load a checkpoint from :func:`save_checkpoint` (or a plain optimizer checkpoint).

    Returns the branch taken: ``"main_params"``, ``"plain"`` (main params rebuilt from the model,
    with a warning) or ``"model_only"`` (``load_optimizer=False``: model loaded, then
    ``reload_model_params``). Every check runs on the checkpoint metadata before anything is
    written into ``model`` or ``optimizer``.
    """
    _refuse_foreign_dtensors(model)
    keys = _saved_keys(checkpoint_id)
    model_sd = model.state_dict()
    missing_model = sorted(k for k in model_sd if not _has(keys, f"model.{k}"))
    if missing_model:
        raise ValueError(f"checkpoint {os.fspath(checkpoint_id)!r} lacks model entries: "
                         f"{', '.join(missing_model)}")
    if not load_optimizer or optimizer is None:
        dcp.load({"model": model_sd}, checkpoint_id=checkpoint_id)
        model.load_state_dict(model_sd)
        if isinstance(optimizer, MainParamsOptimizer):
            optimizer.reload_model_params()
        return "model_only"
    if not isinstance(optimizer, MainParamsOptimizer):
        raise TypeError(f"load_checkpoint restores a MainParamsOptimizer, got {type(optimizer).__name__}")
    if not _has(keys, "optimizer"):
        raise ValueError(f"checkpoint {os.fspath(checkpoint_id)!r} has no optimizer state; "
                         f"pass load_optimizer=False to load the model only")

    expected = optimizer.main_params_by_fqn()
    present = [fqn for fqn in expected if _has(keys, _MAIN_PREFIX + fqn)]
    section_saved = _has(keys, f"optimizer.{MP_KEY}")
    if present and len(present) < len(expected):
        raise_partial_main_params(fqn for fqn in expected if fqn not in present)
    if not present and expected and section_saved:
        raise_partial_main_params(expected)
    branch = "main_params" if present or not expected else "plain"

    _prime_optimizer_state(optimizer)
    optim_sd = optimizer.state_dict()
    if branch == "plain":
        del optim_sd[MP_KEY]
    for fqn in [f for f in optim_sd["state"] if not _has(keys, f"optimizer.state.{f}")]:
        del optim_sd["state"][fqn]   # saved while still lazy: leaf load_state_dict drops it again
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=checkpoint_id)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return branch
