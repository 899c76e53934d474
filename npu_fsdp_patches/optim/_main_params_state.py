"""Translate leaf-optimizer state dicts between torch's index keys and model-param FQNs.

The FQN layout is the one of torch's ``get_optimizer_state_dict`` (``{"state": {fqn: {...}},
"param_groups": [{..., "params": [fqn, ...]}]}``), with the param groups of all leaf optimizers
concatenated in leaf order. So a plain optimizer checkpoint written by torch's own API loads into
the wrapper, and the wrapper's names never change when params are swapped for main params.
"""
from __future__ import annotations

from typing import Callable

import torch

FqnOf = Callable[[torch.Tensor], str]


def _leaf_params(leaf: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in leaf.param_groups for p in group["params"]]


def leaf_state_dict_by_fqn(leaves: list[torch.optim.Optimizer], fqn_of: FqnOf) -> dict:
    """Merge the leaves' ``state_dict()``s, re-keyed by FQN (state tensors are not copied)."""
    state, groups = {}, []
    for leaf in leaves:
        params = _leaf_params(leaf)
        native = leaf.state_dict()
        for index, param_state in native["state"].items():
            state[fqn_of(params[index])] = param_state
        for group in native["param_groups"]:
            groups.append({**group, "params": [fqn_of(params[i]) for i in group["params"]]})
    return {"state": state, "param_groups": groups}


def _native_state_dicts(leaves: list[torch.optim.Optimizer], state_dict: dict,
                        fqn_of: FqnOf) -> list[dict]:
    """Per-leaf torch-native state dicts; raises on any structural mismatch, loads nothing."""
    saved_groups = state_dict.get("param_groups")
    saved_state = state_dict.get("state", {})
    current = [g for leaf in leaves for g in leaf.param_groups]
    if saved_groups is None or len(saved_groups) != len(current):
        raise ValueError(f"optimizer state has {len(saved_groups or [])} param groups, the wrapped "
                         f"optimizers have {len(current)}")
    problems, known = [], set()
    for g, (saved, group) in enumerate(zip(saved_groups, current)):
        names = [fqn_of(p) for p in group["params"]]
        known.update(names)
        if list(saved["params"]) != names:
            problems.append(f"group {g}: saved params {list(saved['params'])} != current {names}")
    unknown = sorted(set(saved_state) - known)
    if unknown:
        problems.append(f"state for params not in any group: {unknown}")
    if problems:
        raise ValueError("optimizer state does not match the wrapped optimizers: " + "; ".join(problems))

    natives, start = [], 0
    for leaf in leaves:
        params = _leaf_params(leaf)
        n_groups = len(leaf.param_groups)
        groups, index = [], 0
        for saved in saved_groups[start:start + n_groups]:
            count = len(saved["params"])
            groups.append({**saved, "params": list(range(index, index + count))})
            index += count
        start += n_groups
        state = {i: saved_state[fqn_of(p)] for i, p in enumerate(params) if fqn_of(p) in saved_state}
        natives.append({"state": state, "param_groups": groups})
    return natives


def load_leaf_state_dicts(leaves: list[torch.optim.Optimizer], state_dict: dict,
                          fqn_of: FqnOf) -> None:
    """Validate ``state_dict`` against every leaf first, then load each leaf."""
    natives = _native_state_dicts(leaves, state_dict, fqn_of)
    for leaf, native in zip(leaves, natives):
        leaf.load_state_dict(native)
