"""DCP save/load of a model plus a :class:`MainParamsOptimizer`, with checks before loading
(docs/main_params.md, docs/hyper_parallel.md#rfc-001-9-checkpoints).

One ``torch.distributed.checkpoint`` save of ``{"model": ..., "optimizer": ...}`` in one of two
layouts (:mod:`.upstream_layout`)::

    layout="torch" (default)                       layout="upstream"
    model.<fqn>                                    model.<fqn>
    optimizer.state.<fqn>.<name>                   optimizer.state.<fqn>.<name>
    optimizer.state.<fqn>.main_param               optimizer._mixed_precision_optimizer.fp32_from_fp16_params.<fqn>
    optimizer.param_groups.<i>.<key>               optimizer.param_groups.<fqn>.<key> (several leaves; else nested)

``"torch"`` is what torch's own API writes (``get_model_state_dict``/``get_optimizer_state_dict``), so
it loads with ``dcp.load`` + ``set_state_dict`` and the reverse; ``"upstream"`` is what
hyper-parallel's ``Float16OptimizerWithFloat16Params`` and its DCP checkpointer write, so upstream's
wrapper resumes it exactly (hyper-parallel's trainer route saves it). ``load_checkpoint`` reads both,
and our earlier layout (the nested form of ``"upstream"``): it reads the checkpoint metadata *first* and
picks a branch: all main params present -> restored exactly; none -> a plain optimizer's
checkpoint, main params rebuilt from the model with a warning; some -> raise before anything is
written. DTensor entries are resharded by DCP, so a checkpoint loads at another world size.

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
from ._main_params_state import MAIN_PARAMS_KEY, MP_KEY, raise_partial_main_params
from ._rollback import Rollback
from .main_params import MainParamsOptimizer
from .tensors import is_foreign_dtensor
from .upstream_layout import SavedLayout, to_torch_layout, upstream_state_dict

__all__ = ["save_checkpoint", "load_checkpoint", "LAYOUTS"]

#: the layouts save_checkpoint writes
LAYOUTS = ("torch", "upstream")


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


def save_checkpoint(checkpoint_id: str | os.PathLike, model: nn.Module, optimizer: Any, *,
                    layout: str = "torch") -> None:
    """Write model and optimizer state (with the fp32 main params) in one DCP save.

    ``layout="torch"``: the layout of torch's ``get_model_state_dict``/``get_optimizer_state_dict``;
    ``optimizer`` is a :class:`MainParamsOptimizer`, or any torch optimizer (or list of them) for a
    plain optimizer checkpoint in the same layout. ``layout="upstream"``: what hyper-parallel's own
    wrapper and DCP checkpointer write for the same model and leaves (:func:`.upstream_state_dict`),
    for a :class:`MainParamsOptimizer`. Either is checked before anything is written.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"save_checkpoint: layout must be one of {', '.join(LAYOUTS)}, not {layout!r}")
    _refuse_foreign_dtensors(model)
    if layout == "upstream":
        optim_state = upstream_state_dict(model, optimizer)
    else:
        optim_state = get_optimizer_state_dict(model, optimizer)
    dcp.save({"model": get_model_state_dict(model), "optimizer": optim_state}, checkpoint_id=checkpoint_id)


def _saved_layout(checkpoint_id: str | os.PathLike) -> SavedLayout:
    reader = dcp.FileSystemReader(os.fspath(checkpoint_id))
    return SavedLayout.from_keys(reader.read_metadata().state_dict_metadata)


def main_params_branch(saved: SavedLayout, low_precision: list[str]) -> str:
    """``"main_params"`` or ``"plain"`` for a wrapper whose bf16/fp16 params are ``low_precision``
    (docs/hyper_parallel.md#rfc-001-9-checkpoints); raises, naming them, when only some of those the
    checkpoint must hold are there. The RFC section must hold every bf16/fp16 param (upstream's rule);
    torch's layout holds ``main_param`` for the params that have optimizer state."""
    if saved.section:
        expected, section = low_precision, set(saved.section)
        present = [f for f in expected if f in section]
    else:
        expected = [f for f in low_precision if f in saved.state]
        present = [f for f in expected if MAIN_PARAM in saved.state[f]]
    if present and len(present) < len(expected):
        raise_partial_main_params((f for f in expected if f not in present),
                                  f"its {MP_KEY}.{MAIN_PARAMS_KEY} section" if saved.section else "'main_param'")
    return "main_params" if present or not expected else "plain"


def _template(saved: SavedLayout, osd: dict, branch: str, model: nn.Module,
              optimizer: Any) -> dict:
    """The optimizer state dict DCP loads into: only what the checkpoint has, in its layout (the
    main params per param or in the section, the groups nested or flattened)."""
    params = dict(model.named_parameters())
    mains = optimizer.main_params_by_fqn() if isinstance(optimizer, MainParamsOptimizer) else {}

    def main_like(fqn: str) -> torch.Tensor:   # a bf16 run's fp32 master also for a param fp32 here
        return mains[fqn] if fqn in mains else torch.empty_like(params[fqn].detach(), dtype=torch.float32)

    state = {}
    for fqn, entry in osd["state"].items():   # lazy when saved: no state for this param
        kept = {k: v for k, v in entry.items() if k != MAIN_PARAM and k in saved.state.get(fqn, ())}
        if (branch == "main_params" and not saved.section and fqn in params
                and MAIN_PARAM in saved.state.get(fqn, ())):
            kept[MAIN_PARAM] = main_like(fqn)
        if kept:
            state[fqn] = kept
    out: dict = {"state": state}
    if branch == "main_params" and saved.section:
        out[MP_KEY] = {MAIN_PARAMS_KEY: {f: main_like(f) for f in saved.section if f in params}}
    if saved.flat_groups:
        for group in osd["param_groups"]:
            for fqn in group["params"]:
                out.update({f"param_groups.{fqn}.{k}": v for k, v in group.items()
                            if k in saved.flat_groups.get(fqn, ())})
    else:
        out["param_groups"] = [{k: v for k, v in group.items() if k in saved.nested_groups.get(i, ())}
                               for i, group in enumerate(osd["param_groups"])]
    return out


def load_checkpoint(checkpoint_id: str | os.PathLike, model: nn.Module,
                    optimizer: Any = None, *, load_optimizer: bool = True) -> str:
    """Load a checkpoint of :func:`save_checkpoint` (either layout), of torch's API, of hyper-parallel's
    own wrapper and DCP checkpointer, or of the earlier layout.

    Returns the branch taken: ``"main_params"``, ``"plain"`` (main params rebuilt from the model,
    with a warning) or ``"model_only"`` (``load_optimizer=False``: model loaded, then
    ``reload_model_params``) or ``"plain_optimizer"`` (``optimizer`` is no MainParamsOptimizer:
    saved main params are not loaded). Every check runs on the checkpoint metadata before anything
    is written into ``model`` or ``optimizer``; params are matched by FQN.
    """
    _refuse_foreign_dtensors(model)
    saved = _saved_layout(checkpoint_id)
    msd = get_model_state_dict(model)
    present = {".".join(f.split(".")[:i]) for f in saved.model for i in range(1, f.count(".") + 2)}
    missing_model = sorted(k for k in msd if k not in present)   # a nested entry counts by its prefix
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
    if not (saved.state or saved.section or saved.flat_groups or saved.nested_groups):
        raise ValueError(f"checkpoint {os.fspath(checkpoint_id)!r} has no optimizer state; "
                         f"pass load_optimizer=False to load the model only")
    if isinstance(optimizer, MainParamsOptimizer):
        branch = main_params_branch(saved, list(optimizer.main_params_by_fqn()))
    else:
        branch = "plain_optimizer"
    osd = get_optimizer_state_dict(model, optimizer)
    state = {"model": _fresh(msd), "optimizer": _fresh(_template(saved, osd, branch, model, optimizer))}
    dcp.load(state, checkpoint_id=checkpoint_id)
    loaded = to_torch_layout(state["optimizer"], osd["param_groups"])
    with _restored_on_failure(model, optimizer):
        # the model first (torch's set_state_dict loads the optimizer first): main params rebuilt
        # from the model ("plain") must see the loaded model
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=False))
        if isinstance(optimizer, MainParamsOptimizer):
            # keyed by FQN, which the wrapper matches itself (torch's set_optimizer_state_dict needs state
            # for every param on older torch: 2.6 raises KeyError for a param saved without state)
            optimizer.load_state_dict(loaded)
        else:
            set_optimizer_state_dict(model, optimizer, loaded, options=StateDictOptions(strict=False))
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
