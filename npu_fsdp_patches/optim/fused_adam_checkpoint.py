"""FusedAdam ``state_dict`` / ``load_state_dict`` with DTensor metadata
(docs/te_fused_adam.md#rfc-339-state-dict, NVTE >= 2.14).

Saving exports every float state as unscaled fp32 and re-wraps it with the param's mesh, placements,
global shape and stride, so ``torch.distributed.checkpoint`` can save it and reshard it on load. The
int16 remainder of a plain bf16 param is exported raw, as TE does.

Loading maps the saved entries to the current params by position, converts every saved value to the
param's local shard *before* anything is changed (a bad entry raises with nothing half-loaded), lets
``torch.optim.Optimizer`` restore the param groups, then stores each value back in its configured
dtype with a fresh scale; a failure there restores the optimizer as it was (validate, then commit:
docs/design.md#validate-then-commit).

Another optimizer's state loads with its step (:func:`carried_steps`): FusedAdam counts steps per group
(TE's ``group["step"]``), torch's Adam/AdamW per param (``state[i]["step"]``). A group whose saved params
share one step takes it as the group step; one whose params were stepped a different number of times,
or whose state FusedAdam could not honour (AMSGrad, ``maximize``, the other weight-decay mode, state
FusedAdam does not keep), is refused with the reason, before anything is written: never a silent
restart of bias correction with kept moments (docs/te_fused_adam.md#loading-another-optimizers-state).
"""
from __future__ import annotations

from itertools import chain

import torch

from ._rollback import Rollback
from .fused_adam_state import STATE_NAMES, describe, get_unscaled, set_scaled, uses_remainders, wrap_like
from .tensors import is_torch_dtensor, local_tensor


def _flat(groups):
    return list(chain.from_iterable(g["params"] for g in groups))


def export_state(opt, packed: dict) -> dict:
    """Rewrite ``packed`` (from ``torch.optim.Optimizer.state_dict``) with unscaled, wrapped states."""
    id_map = dict(zip(_flat(packed["param_groups"]), _flat(opt.param_groups)))
    for key, entry in list(packed["state"].items()):
        param = id_map.get(key)
        if param is None:
            continue
        packed["state"][key] = {
            name: (wrap_like(param, get_unscaled(opt, param, name))
                   if name in STATE_NAMES and torch.is_tensor(value) else value)
            for name, value in entry.items()}
    return packed


def _local_piece(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's piece of the full tensor ``full`` for DTensor ``param``, cut locally with no
    collective (torch 2.6's ``distribute_tensor`` has no ``src_data_rank`` and would broadcast)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh,
                                                          param.placements)
    return full[tuple(slice(start, start + size) for start, size in zip(offset, shape))].clone()


def _saved_to_local(opt, param, name: str, value: torch.Tensor) -> torch.Tensor:
    """One saved state as a tensor shaped like ``param``'s local shard, on its device."""
    loc = local_tensor(param)
    if is_torch_dtensor(param):
        if is_torch_dtensor(value):
            if value.shape != param.shape:
                raise RuntimeError(f"FusedAdam.load_state_dict: saved {name} of "
                                   f"{describe(opt, param)} has global shape "
                                   f"{tuple(value.shape)}, expected {tuple(param.shape)}")
            if value.placements != param.placements or value.device_mesh != param.device_mesh:
                value = value.redistribute(param.device_mesh, param.placements)
            value = value._local_tensor
        elif value.shape == param.shape:
            value = _local_piece(value.to(loc.device), param)
        elif value.shape != loc.shape:
            raise RuntimeError(f"FusedAdam.load_state_dict: saved {name} of {describe(opt, param)} "
                               f"has shape {tuple(value.shape)}; expected the global shape "
                               f"{tuple(param.shape)} or the local shape {tuple(loc.shape)}")
    else:
        if is_torch_dtensor(value):
            value = value.full_tensor()
        if value.shape != param.shape:
            raise RuntimeError(f"FusedAdam.load_state_dict: saved {name} of {describe(opt, param)} "
                               f"has shape {tuple(value.shape)}, expected {tuple(param.shape)}")
    remainder = name == "master_param" and opt.master_weights and uses_remainders(opt, param)
    if remainder != (value.dtype == torch.int16):
        raise RuntimeError(f"FusedAdam.load_state_dict: saved {name} of {describe(opt, param)} is "
                           f"{value.dtype}, but this optimizer "
                           f"{'stores' if remainder else 'does not store'} int16 param remainders")
    return value.to(device=loc.device, dtype=torch.int16 if remainder else torch.float32)


#: per-param state keys FusedAdam keeps besides its STATE_NAMES (torch's per-param step, carried to the group)
_FOREIGN_STEP = "step"


def _as_step(value, where: str) -> int:
    number = float(value.item() if torch.is_tensor(value) else value)
    if number != int(number) or number < 0:
        raise ValueError(f"FusedAdam.load_state_dict: {where} has step {number}, not a step count; nothing "
                         f"was loaded")
    return int(number)


def carried_steps(opt, state_dict: dict) -> list:
    """Per saved group, the step FusedAdam's ``group["step"]`` takes (``None``: the group's own, as saved).

    A group of another optimizer's state (no group ``step``; torch's Adam/AdamW keep one per param) takes
    the step its params share. Refused with the reason, before anything is written: params of one group
    stepped different numbers of times (one group step cannot give each its bias correction), moments
    without any step (the bias correction would restart at 1 over trained moments), a group step that
    contradicts its params' steps, and state FusedAdam cannot honour (AMSGrad's ``max_exp_avg_sq``,
    ``maximize``, the other weight-decay mode, any other per-param tensor)."""
    steps = []
    saved_state = state_dict["state"]
    for gi, group in enumerate(state_dict["param_groups"]):
        where = f"param group {gi} of the state dict"
        for flag, why in (("amsgrad", "FusedAdam has no AMSGrad: max_exp_avg_sq would be ignored"),
                          ("maximize", "FusedAdam does not maximize: the update would change sign")):
            if group.get(flag):
                raise ValueError(f"FusedAdam.load_state_dict: {where} has {flag}=True; {why}. Nothing was loaded.")
        decoupled = group.get("decoupled_weight_decay")
        if decoupled is not None and group.get("weight_decay") and bool(decoupled) != bool(opt.adam_w_mode):
            raise ValueError(f"FusedAdam.load_state_dict: {where} was saved with decoupled_weight_decay="
                             f"{bool(decoupled)} (weight_decay={group['weight_decay']}), this FusedAdam has "
                             f"adam_w_mode={bool(opt.adam_w_mode)}: the weight decay would change meaning. "
                             f"Build FusedAdam with adam_w_mode={bool(decoupled)}. Nothing was loaded.")
        entries = {key: saved_state[key] for key in group["params"] if isinstance(saved_state.get(key), dict)}
        for key, entry in entries.items():
            extra = [name for name, value in entry.items()
                     if torch.is_tensor(value) and name not in STATE_NAMES and name != _FOREIGN_STEP]
            if extra:
                raise ValueError(f"FusedAdam.load_state_dict: the saved state of param {key!r} ({where}) holds "
                                 f"{extra}, which FusedAdam does not keep (it keeps {list(STATE_NAMES)}); they "
                                 f"would be ignored. Nothing was loaded.")
        per_param = {key: _as_step(entry[_FOREIGN_STEP], f"param {key!r} of {where}")
                     for key, entry in entries.items() if _FOREIGN_STEP in entry}
        own = group.get("step")
        if not per_param:
            if own is None and any(name in entry for entry in entries.values() for name in ("exp_avg", "exp_avg_sq")):
                raise ValueError(f"FusedAdam.load_state_dict: {where} has moments but no step, neither per "
                                 f"group (TE) nor per param (torch): their bias correction cannot be resumed. "
                                 f"Nothing was loaded.")
            steps.append(None)
            continue
        distinct = sorted(set(per_param.values()))
        if len(distinct) > 1:
            listed = ", ".join(f"param {k!r}: {v}" for k, v in list(per_param.items())[:6])
            raise ValueError(f"FusedAdam.load_state_dict: the params of {where} were stepped different numbers "
                             f"of times ({listed}); FusedAdam keeps one step per group (TE's group['step']), "
                             f"so it cannot resume each one's bias correction. Nothing was loaded. Put params "
                             f"with different step counts in different param groups.")
        if own is not None and _as_step(own, where) != distinct[0]:
            raise ValueError(f"FusedAdam.load_state_dict: {where} has group step {own} but its params' steps "
                             f"are {distinct[0]}. Nothing was loaded.")
        steps.append(distinct[0])
    return steps


def import_state(opt, state_dict: dict) -> None:
    """Load ``state_dict`` (from :func:`export_state`, possibly through DCP, or another optimizer's:
    :func:`carried_steps`) into ``opt``."""
    saved_ids = _flat(state_dict["param_groups"])
    params = _flat(opt.param_groups)
    if len(saved_ids) != len(params):
        raise ValueError(f"FusedAdam.load_state_dict: the state dict has {len(saved_ids)} params, "
                         f"the optimizer has {len(params)}")
    id_map = dict(zip(saved_ids, params))
    steps = carried_steps(opt, state_dict)
    prepared = {}
    for key, entry in state_dict["state"].items():
        param = id_map.get(key)
        if param is None:
            raise KeyError(f"FusedAdam.load_state_dict: state entry {key!r} matches no param")
        prepared[param] = {
            name: (_saved_to_local(opt, param, name, value)
                   if name in STATE_NAMES and torch.is_tensor(value) else value)
            for name, value in entry.items() if value is not None and name != _FOREIGN_STEP}
    rollback = Rollback()   # torch's load and the re-scaling can still fail midway: undone
    rollback.optimizer(opt)
    rollback.dict(opt._scales)
    try:
        torch.optim.Optimizer.load_state_dict(
            opt, {"state": {}, "param_groups": state_dict["param_groups"]})
        for group, step in zip(opt.param_groups, steps):
            if step is not None:
                group["step"] = step   # carried from the params' own steps (torch's layout)
            if "step" in group:
                group["step"] = int(group["step"])
        for param, entry in prepared.items():
            opt.state[param] = {}
            opt._scales.pop(param, None)
            for name, value in entry.items():
                if name in STATE_NAMES and torch.is_tensor(value):
                    set_scaled(opt, param, name, value)
                else:
                    opt.state[param][name] = value
    except BaseException:
        rollback.restore()
        raise
