"""The state dict of a main-params wrapper in torch's own layout, and its loading.

The wrapper's ``state_dict()`` is what a plain optimizer over the *model* params would give:
``{"state": {index: {...}}, "param_groups": [{..., "params": [index, ...]}]}``, indices counting
the model params of all leaf optimizers' groups in leaf order. A bf16/fp16 param's entry also holds
``"main_param"``, its fp32 main param (the very tensor, so DCP saves and loads it in place). So
torch's ``get_optimizer_state_dict``/``set_optimizer_state_dict`` map it to FQNs by identity like
any optimizer, and DCP reshards it.

It also carries hyper-parallel's RFC section ``_mixed_precision_optimizer.fp32_from_fp16_params``
(``{fqn: main param}``, every bf16/fp16 param, ``{}`` for an fp32 model) holding the *same* tensor
objects, so upstream's ``Float16OptimizerWithFloat16Params`` loads it (docs/main_params.md §2.1).
torch's ``get_optimizer_state_dict`` keeps only ``state``/``param_groups``, so DCP writes each main
param once; ``torch.save`` writes a shared storage once. Over hyper-parallel DTensors, which never
reach torch's API, :func:`fqn_layout` gives upstream's own layout instead (the section the only copy).
Loading reads the section when present (:func:`merge_rfc_section`), with state keyed by index or by
FQN, nested or flattened (:func:`unflatten`); :func:`upgrade_legacy` serves DCP checkpoints of the
earlier layout.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Iterable

import torch

from ._leaf_views import MAIN_PARAM
from .tensors import local_tensor

#: the earlier layout's section of fp32 main params, ``{MP_KEY: {MAIN_PARAMS_KEY: {fqn: tensor}}}``
MP_KEY = "_mixed_precision_optimizer"
MAIN_PARAMS_KEY = "fp32_from_fp16_params"

ModelOf = Callable[[torch.Tensor], torch.Tensor]


def _leaf_params(leaf: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in leaf.param_groups for p in group["params"]]


def native_state_dict(leaves: list[torch.optim.Optimizer], model_of: ModelOf,
                      with_main_param: bool = True) -> dict:
    """The leaves' ``state_dict()``s merged and renumbered; ``"main_param"`` added (with
    ``with_main_param``) where the model param is not its own main param, also to a param the leaf keeps
    no state for (no grad so far, or an optimizer without state, SGD without momentum, that still steps
    it): the main param is the wrapper's own state of it. State tensors are not copied."""
    state, groups, offset = {}, [], 0
    for leaf in leaves:
        mains = _leaf_params(leaf)
        native = leaf.state_dict()
        for index, main in enumerate(mains):
            param_state = native["state"].get(index)
            if with_main_param and model_of(main) is not main:
                param_state = {**(param_state or {}), MAIN_PARAM: main}
            if param_state is not None:
                state[offset + index] = param_state
        for group in native["param_groups"]:
            groups.append({**group, "params": [offset + i for i in group["params"]]})
        offset += len(mains)
    return {"state": state, "param_groups": groups}


def fqn_layout(native: dict, fqns: list[str], flatten: bool) -> dict:
    """``native`` (index-keyed, from :func:`native_state_dict`) keyed by FQN, as hyper-parallel's
    ``ChainedOptimizer.state_dict`` gives it: nested, or torch's flattened layout
    (``state.<fqn>.<key>``, ``param_groups.<fqn>.<key>``) with ``flatten``. Tensors are not copied."""
    state = {fqns[i]: value for i, value in native["state"].items()}
    groups = [{**g, "params": [fqns[i] for i in g["params"]]} for g in native["param_groups"]]
    if not flatten:
        return {"state": state, "param_groups": groups}
    flat = {f"state.{fqn}.{k}": v for fqn, entry in state.items() for k, v in entry.items()}
    for group in groups:
        for fqn in group["params"]:
            flat.update({f"param_groups.{fqn}.{k}": v for k, v in group.items() if k != "params"})
    return flat


def rfc_section(mains_by_fqn: dict[str, torch.Tensor]) -> dict:
    """``{MAIN_PARAMS_KEY: {fqn: main param}}``: the very tensors, no copy (+0 B)."""
    return {MAIN_PARAMS_KEY: dict(mains_by_fqn)}


def unflatten(state_dict: dict, group_fqns: list[list[str]], current: list[dict]) -> dict:
    """A state dict in torch's flattened layout (``state.<fqn>.<key>``, ``param_groups.<fqn>.<key>``,
    as upstream's ``ChainedOptimizer(flatten=True)`` saves Muon + AdamW) rebuilt nested over our
    groups' FQNs; any other layout is returned as is. State and group keys hold no dot, so
    ``state.a.b.exp_avg`` belongs to ``a.b``, never to ``a``. A group without params has no
    flattened entries: it keeps its ``current`` settings."""
    if "state" in state_dict or "param_groups" in state_dict or not any(
            isinstance(k, str) and k.startswith(("state.", "param_groups.")) for k in state_dict):
        return state_dict

    def entries(kind: str, fqn: str) -> dict:
        prefix = f"{kind}.{fqn}."
        return {k[len(prefix):]: v for k, v in state_dict.items()
                if isinstance(k, str) and k.startswith(prefix) and "." not in k[len(prefix):]}

    fqns = [f for group in group_fqns for f in group]
    state = {f: entries("state", f) for f in fqns}
    groups = [{**({k: v for k, v in now.items() if k != "params"} if not group
                  else entries("param_groups", group[0])), "params": list(group)}
              for group, now in zip(group_fqns, current)]
    rest = {k: v for k, v in state_dict.items()
            if not (isinstance(k, str) and k.startswith(("state.", "param_groups.")))}
    return rest | {"state": {f: v for f, v in state.items() if v}, "param_groups": groups}


def merge_rfc_section(state_dict: dict, fqns: list[str], low_precision: Iterable[str],
                      owner: str) -> tuple[dict, list[list[str | None]] | None]:
    """``state_dict`` with its RFC section (if any) moved into the per-param state as
    ``"main_param"`` (upstream's layout, where the section is the only copy), and the names the
    section gives the saved params, per saved group (``None`` where it names none).

    Where per-param entries exist (ours), the section holds their very tensors (also after
    ``torch.save``/``torch.load`` or ``deepcopy``, which keep shared objects shared): each entry's
    FQN names the saved param whose ``main_param`` it is, so :func:`split_by_leaf` loads by name.
    Otherwise saved params map to ``fqns`` (ours, in group order) by their FQN keys or
    ``param_names``, else by position, as torch's ``load_state_dict`` does. A section that lacks any
    of the ``low_precision`` FQNs is refused, naming them, before anything is written."""
    if MP_KEY not in state_dict:
        return state_dict, None
    section = state_dict[MP_KEY]
    mains = section.get(MAIN_PARAMS_KEY) if isinstance(section, Mapping) else None
    if not isinstance(mains, Mapping):
        raise ValueError(f"{owner}.load_state_dict: {MP_KEY!r} must be a mapping holding "
                         f"{MAIN_PARAMS_KEY!r}: {{fqn: fp32 main param}}; got {type(section).__name__}")
    missing = sorted(f for f in low_precision if f not in mains)
    if missing:
        raise ValueError(
            f"{owner}.load_state_dict: the {MP_KEY}.{MAIN_PARAMS_KEY} section lacks the fp32 main "
            f"params of {len(missing)} bf16/fp16 param(s): {', '.join(missing)}. Refusing to load "
            f"(nothing was written) rather than rebuilding them from the low-precision model params.")
    rest = {k: v for k, v in state_dict.items() if k != MP_KEY}
    groups = rest.get("param_groups")
    if any(_has_main_param(entry) for entry in rest.get("state", {}).values()):
        return rest, names_by_identity(groups, rest.get("state", {}), mains)   # ours: same tensors
    keys = [k for g in groups for k in g["params"]] if isinstance(groups, list) else []
    if len(keys) != len(fqns):
        return rest, None   # split_by_leaf names the structural mismatch
    state = {key: dict(value) for key, value in rest.get("state", {}).items()}
    for key, fqn in zip(keys, _saved_names(groups, fqns)):
        if fqn in mains:
            state.setdefault(key, {})[MAIN_PARAM] = mains[fqn]
    return rest | {"state": state}, None


def names_by_identity(groups: Any, state: Mapping, mains: Mapping) -> list[list[str | None]] | None:
    """Per saved group, the section's FQN of each saved param whose ``main_param`` is a section
    entry's very tensor (or the same storage, offset, shape and stride), else ``None``."""
    if not isinstance(groups, list):
        return None
    by_id = {id(t): fqn for fqn, t in mains.items()}
    by_storage = {}
    for fqn, t in mains.items():
        where = _storage_identity(t)
        if where is not None:
            by_storage[where] = None if where in by_storage else fqn   # two entries: no name
    names = []
    for group in groups:
        row = []
        for key in group["params"]:
            entry = state.get(key)
            main = entry.get(MAIN_PARAM) if isinstance(entry, Mapping) else None
            name = by_id.get(id(main)) if main is not None else None
            if name is None and isinstance(main, torch.Tensor):
                name = by_storage.get(_storage_identity(main))
            row.append(name)
        names.append(row)
    return names


def _storage_identity(t: Any) -> tuple | None:
    """Where a non-empty tensor's local data lives; ``None`` for an empty one (no storage to tell by)."""
    if not isinstance(t, torch.Tensor):
        return None
    local = local_tensor(t)
    if local.numel() == 0:
        return None
    return (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape), local.stride())


def _has_main_param(entry: Any) -> bool:
    value = entry.get(MAIN_PARAM) if isinstance(entry, Mapping) else None
    return value is not None and not isinstance(value, Mapping)   # torch's unflattening leaves {}


def _saved_names(groups: list[dict], fqns: list[str]) -> list[str]:
    """The FQN each saved param stands for: its key where keys are FQNs (upstream's layout), its
    ``param_names`` entry where the group names them, else ours at the same position. A checkpoint
    of a model that declares its params in another order then still pairs each section entry with
    the state of the same param, and ``split_by_leaf`` reorders both by name."""
    names: list[str] = []
    for group in groups:
        keys = list(group["params"])
        if keys and all(isinstance(k, str) for k in keys):
            names.extend(keys)
        elif "param_names" in group and len(group["param_names"]) == len(keys):
            names.extend(group["param_names"])
        else:
            names.extend(fqns[len(names):len(names) + len(keys)])
    return names


def upgrade_legacy(state_dict: dict) -> dict:
    """A state dict of the earlier layout with its main params moved into the per-param state
    (FQN keys stay: loading maps saved params to current ones by position, as torch does)."""
    section = state_dict.get(MP_KEY)
    if section is None:
        return state_dict
    saved_mains = section.get(MAIN_PARAMS_KEY, {})
    state = {key: dict(value) for key, value in state_dict.get("state", {}).items()}
    for fqn, main in saved_mains.items():
        state.setdefault(fqn, {})[MAIN_PARAM] = main
    return {key: value for key, value in state_dict.items() if key != MP_KEY} | {"state": state}


def split_by_leaf(leaves: list[torch.optim.Optimizer], state_dict: dict, model_of: ModelOf,
                  owner: str, fqn_of: Callable[[torch.Tensor], str] | None = None,
                  saved_names: list[list[str | None]] | None = None,
                  ) -> tuple[list[dict], dict[torch.Tensor, Any], dict[torch.Tensor, Any]]:
    """Per-leaf torch-native state dicts (without ``"main_param"``), ``{model param: saved main
    param or None}`` for the bf16/fp16 params that have saved state, and ``{fp32 param: saved main
    param}`` for fp32 params whose saved state has one (a bf16 model's checkpoint: the fp32 master is
    the value to resume from). Saved params map to the current ones by name where the state dict
    names them (FQN keys, ``param_names`` on both sides, or ``saved_names`` from the RFC section, see
    :func:`merge_rfc_section`), else by position, as in torch's
    ``Optimizer.load_state_dict``; any structural mismatch (group sizes, names, order, shapes) raises
    before anything is loaded, naming what does not match."""
    saved_groups = state_dict.get("param_groups")
    current = [g for leaf in leaves for g in leaf.param_groups]
    if not isinstance(saved_groups, list) or len(saved_groups) != len(current):
        raise ValueError(f"{owner}.load_state_dict: the state dict has "
                         f"{len(saved_groups) if isinstance(saved_groups, list) else 'no'} param "
                         f"groups, the wrapped optimizers have {len(current)}")
    sizes = [(len(s["params"]), len(g["params"])) for s, g in zip(saved_groups, current)]
    if any(a != b for a, b in sizes):
        raise ValueError(f"{owner}.load_state_dict: saved param group sizes {[a for a, _ in sizes]} "
                         f"do not match the wrapped optimizers' {[b for _, b in sizes]}")
    saved_state = {key: entry for key, entry in
                   ((k, _without_unflatten_fillers(e)) for k, e in state_dict.get("state", {}).items()) if entry}
    group_keys = [_keys_in_current_order(s, g, gi, model_of, fqn_of, owner,
                                         saved_names[gi] if saved_names and fqn_of else None)
                  for gi, (s, g) in enumerate(zip(saved_groups, current))]
    keys = [k for g in group_keys for k in g]
    known = set(keys)
    unknown = [k for k in saved_state if k not in known]
    if unknown:
        raise ValueError(f"{owner}.load_state_dict: state for params in no param group: {unknown}")
    mains_flat = [p for g in current for p in g["params"]]
    _check_positions(keys, mains_flat, saved_state, model_of, fqn_of, owner)
    natives, saved_mains, fp32_mains, start = [], {}, {}, 0
    for leaf in leaves:
        mains = _leaf_params(leaf)
        leaf_groups = saved_groups[start:start + len(leaf.param_groups)]
        leaf_group_keys = group_keys[start:start + len(leaf.param_groups)]
        start += len(leaf.param_groups)
        groups, leaf_keys = [], []
        for saved, ordered, cur in zip(leaf_groups, leaf_group_keys, leaf.param_groups):
            group = {**saved, "params": list(range(len(leaf_keys), len(leaf_keys) + len(ordered)))}
            if "param_names" in saved and "param_names" in cur:
                group["param_names"] = list(cur["param_names"])   # reordered by name above
            groups.append(group)
            leaf_keys.extend(ordered)
        state = {}
        for index, (key, main) in enumerate(zip(leaf_keys, mains)):
            if key not in saved_state:
                continue
            param_state = dict(saved_state[key])
            saved_main = param_state.pop(MAIN_PARAM, None)
            if model_of(main) is not main:   # bf16/fp16: its saved main param, or None
                saved_mains[model_of(main)] = saved_main
            elif saved_main is not None:     # fp32 here, low precision when saved
                fp32_mains[main] = saved_main
            if param_state:   # a section entry of a param the leaf has no state for yet adds none
                state[index] = param_state
        natives.append({"state": state, "param_groups": groups})
    return natives, saved_mains, fp32_mains


def _without_unflatten_fillers(entry: Any) -> Any:
    """``entry`` without the ``{}`` torch's flattened load puts for each key of its template that the
    checkpoint lacks (torch 2.13, ``strict=False``): all a param without saved state gets, and the
    moments of one whose leaf had no state for it when saved."""
    if not isinstance(entry, Mapping):
        return entry
    return {key: value for key, value in entry.items() if not (isinstance(value, Mapping) and not value)}


#: per-param states shaped like the param (torch's Adam/AdamW/SGD/Muon, and the main param)
_PARAM_SHAPED = (MAIN_PARAM, "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer")


def _keys_in_current_order(saved: dict, current: dict, gi: int, model_of: ModelOf,
                           fqn_of: Callable[[torch.Tensor], str] | None, owner: str,
                           section_names: list[str | None] | None = None) -> list:
    """The saved group's keys reordered to the current params' order where the state dict names its
    params (FQN keys of the earlier layout and upstream's, ``param_names`` on both groups, or the
    RFC section's names for some of them); else as saved."""
    keys = list(saved["params"])
    if "param_names" in saved and "param_names" in current:
        saved_names, names = list(saved["param_names"]), list(current["param_names"])
    elif fqn_of is not None and keys and all(isinstance(k, str) for k in keys):
        saved_names, names = keys, [fqn_of(model_of(p)) for p in current["params"]]
    elif section_names is not None and any(n is not None for n in section_names):
        return _keys_by_some_names(keys, section_names, [fqn_of(model_of(p)) for p in current["params"]],
                                   gi, owner)
    else:
        return keys
    if saved_names == names:
        return keys
    if sorted(saved_names) != sorted(names) or len(set(names)) != len(names):
        _refuse_other_names(gi, saved_names, names, owner)
    by_name = dict(zip(saved_names, keys))
    return [by_name[n] for n in names]   # same params, other order: loaded by name


def _refuse_other_names(gi: int, saved_names: list, names: list, owner: str) -> None:
    extra = sorted(set(saved_names) - set(names) - {None})
    lacking = sorted(set(names) - set(saved_names))
    raise ValueError(f"{owner}.load_state_dict: param group {gi} of the state dict names other params "
                     f"than the optimizer's: saved but not here: {', '.join(extra) or '-'}; here but "
                     f"not saved: {', '.join(lacking) or '-'}. Nothing was loaded.")


def _keys_by_some_names(keys: list, saved_names: list, names: list[str], gi: int, owner: str) -> list:
    """Keys in the current order when only some saved params are named (the RFC section names the
    bf16/fp16 ones): named ones go to their param, the unnamed fill the rest in saved order. That is
    certain only when at most one is unnamed, or when the names show the saved order is ours."""
    named = [n for n in saved_names if n is not None]
    stray = sorted({n for n in named if n not in names} | {n for n in named if named.count(n) > 1})
    if stray:
        raise ValueError(f"{owner}.load_state_dict: param group {gi} of the state dict holds the main params "
                         f"of {', '.join(stray)} (named by its {MP_KEY} section), which are not params of the "
                         f"optimizer's group {gi} (or are named twice). Nothing was loaded.")
    if all(n is None or n == here for n, here in zip(saved_names, names)):
        return keys   # the names agree with the positions
    placed: list = [None] * len(names)
    for key, name in zip(keys, saved_names):
        if name is not None:
            placed[names.index(name)] = key
    free = [i for i, key in enumerate(placed) if key is None]
    unnamed = [key for key, name in zip(keys, saved_names) if name is None]
    if len(unnamed) > 1:
        raise ValueError(
            f"{owner}.load_state_dict: the state dict's params are in another order than the "
            f"optimizer's (its {MP_KEY} section names {', '.join(repr(n) for n in named)} at other "
            f"positions), and it names no param for {', '.join(repr(names[i]) for i in free)} of param "
            f"group {gi}, so their order cannot be told. Nothing was loaded. Load it by name (torch's "
            f"set_optimizer_state_dict or load_checkpoint, keyed by FQN), or build the model and "
            f"optimizer with the saved order.")
    for i, key in zip(free, unnamed):
        placed[i] = key
    return placed


def _shape(t: torch.Tensor) -> tuple:
    return tuple(t.shape)


def _check_positions(keys: list, mains: list, saved_state: dict, model_of: ModelOf,
                     fqn_of: Callable[[torch.Tensor], str] | None, owner: str) -> None:
    """Refuse, before any write, saved states that do not line up with the params at their
    positions: param-shaped states (moments, momentum, main param) of another shape, or fp32 main
    params saved at the positions of fp32 params while bf16/fp16 params lack theirs. Either is
    named as an order mismatch when the saved states fit the params in another order."""
    def name(i: int) -> str:
        return repr(fqn_of(model_of(mains[i]))) if fqn_of is not None else f"param {i}"

    def saved_shape(key: Any) -> tuple | None:
        entry = saved_state.get(key, {})
        for k in _PARAM_SHAPED:
            value = entry.get(k) if isinstance(entry, dict) else None
            if isinstance(value, torch.Tensor):
                return _shape(value)
        return None

    def fits(shape: tuple | None, p: torch.Tensor) -> bool:
        return shape is None or shape in (_shape(p), _shape(local_tensor(p)))

    shapes = [saved_shape(k) for k in keys]
    bad = [i for i, (shape, p) in enumerate(zip(shapes, mains)) if not fits(shape, p)]
    low = [model_of(p) is not p for p in mains]
    has_main = [isinstance(saved_state.get(k, {}).get(MAIN_PARAM) if isinstance(saved_state.get(k), dict)
                           else None, torch.Tensor) for k in keys]
    crossed = any(lp and not hm and k in saved_state for lp, hm, k in zip(low, has_main, keys)) and \
        any(hm and not lp for lp, hm in zip(low, has_main))
    if not bad and not crossed:
        return
    known = [s for s in shapes if s is not None]
    permuted = sorted(known) == sorted(_shape(p) for p, s in zip(mains, shapes) if s is not None)
    if crossed or permuted:
        where = "; ".join(f"saved position {i} holds state of shape {shapes[i]}, the param there is "
                          f"{name(i)} of shape {_shape(mains[i])}" for i in bad[:4])
        if crossed:
            lacking = [name(i) for i, (lp, hm) in enumerate(zip(low, has_main)) if lp and not hm]
            extra = [name(i) for i, (lp, hm) in enumerate(zip(low, has_main)) if hm and not lp]
            where = "; ".join(filter(None, [where, f"fp32 main params are saved at the positions of the "
                                            f"fp32 params {', '.join(extra)} but missing at the bf16/fp16 "
                                            f"params {', '.join(lacking)}"]))
        raise ValueError(f"{owner}.load_state_dict: the state dict's params are in another order than "
                         f"the optimizer's ({where}): the model declares its params in another order "
                         f"than the run that saved it. Nothing was loaded. Load it by name (torch's "
                         f"set_optimizer_state_dict or load_checkpoint, keyed by FQN), or build the "
                         f"model and optimizer with the saved order.")
    raise ValueError(f"{owner}.load_state_dict: saved state does not match the params' shapes: "
                     + "; ".join(f"{name(i)} has shape {_shape(mains[i])}, its saved state {shapes[i]}"
                                 for i in bad[:4]) + ". Nothing was loaded.")


def raise_partial_main_params(missing: Iterable[str], where: str = "'main_param'") -> None:
    """Refuse a state that has the main params of some bf16/fp16 params only, naming the others."""
    missing = sorted(missing)
    raise ValueError(
        f"optimizer state is incomplete: it holds the fp32 main params ({where}) of some "
        f"bf16/fp16 params but not of {len(missing)} other(s): {', '.join(missing)}. Refusing to "
        f"load (nothing was written) rather than silently rebuilding them from the low-precision "
        f"model params.")


def check_main_param(dst: torch.Tensor, src: Any, name: str) -> None:
    """Refuse a saved main param that cannot be copied into ``dst`` (run before any write)."""
    if not isinstance(src, torch.Tensor):
        raise TypeError(f"main param of {name!r}: saved value is a {type(src).__name__}, not a tensor")
    dst_local, src_local = local_tensor(dst), local_tensor(src)
    if dst_local.shape != src_local.shape:
        raise ValueError(f"main param of {name!r}: saved local shape {tuple(src_local.shape)} does not "
                         f"match {tuple(dst_local.shape)}; load sharded checkpoints through torch's "
                         f"set_optimizer_state_dict or DCP, which reshard")
    if not src_local.is_floating_point():
        raise TypeError(f"main param of {name!r}: saved dtype {src_local.dtype} is not a float dtype")


def copy_into_main(dst: torch.Tensor, src: Any, name: str) -> None:
    """Copy a saved main param into ``dst`` local shard to local shard (no collective)."""
    check_main_param(dst, src, name)
    dst_local, src_local = local_tensor(dst), local_tensor(src)
    if dst_local is src_local:
        return
    with torch.no_grad():
        dst_local.copy_(src_local)


def drop_main_params(optim_state_dict: dict) -> dict:
    """``optim_state_dict`` (torch's nested or flattened layout, or this wrapper's) without the fp32
    main params: what a plain optimizer over the same model loads (its ``load_state_dict`` would
    otherwise keep them as state, cast to the param dtype). A new dict; tensors are not copied."""
    suffix = f".{MAIN_PARAM}"
    if "state" not in optim_state_dict:   # flattened: "state.<fqn>.main_param"
        return {k: v for k, v in optim_state_dict.items()
                if not (k.startswith("state.") and k.endswith(suffix))}
    state = {key: {k: v for k, v in value.items() if k != MAIN_PARAM}
             for key, value in optim_state_dict["state"].items()}
    return {k: v for k, v in optim_state_dict.items() if k != MP_KEY} | {"state": state}
