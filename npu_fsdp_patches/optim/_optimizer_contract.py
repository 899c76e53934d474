"""The parts of ``torch.optim.Optimizer`` a wrapper optimizer that holds no params must set up itself.

``Optimizer.__init__`` needs a non-empty param list and assigns ``state``/``param_groups``, which a
wrapper exposes as views of its inner optimizers; so a wrapper cannot call it. Without what it
sets up, hooks registered on the wrapper are accepted and never fire. This module sets up the same
hook tables and step patch, and runs the state-dict hooks exactly as ``Optimizer.state_dict`` and
``Optimizer.load_state_dict`` do (torch/optim/optimizer.py). A wrapper's step is one step to torch
code: :func:`pause_global_step_hooks` keeps the global step hooks from also firing for its leaves.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import torch
from torch.optim import optimizer as torch_optimizer

__all__ = ["init_optimizer_contract", "run_state_dict_hooks", "run_load_state_dict_hooks",
           "pause_global_step_hooks", "resume_global_step_hooks", "split_non_param_state"]

_GLOBAL_HOOKS = ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")


def init_optimizer_contract(optimizer: torch.optim.Optimizer) -> None:
    """What ``Optimizer.__init__`` sets up apart from params: hook tables and the hooked ``step``."""
    torch._C._log_api_usage_once("python.optimizer")
    optimizer._optimizer_step_pre_hooks = OrderedDict()
    optimizer._optimizer_step_post_hooks = OrderedDict()
    optimizer._optimizer_state_dict_pre_hooks = OrderedDict()
    optimizer._optimizer_state_dict_post_hooks = OrderedDict()
    optimizer._optimizer_load_state_dict_pre_hooks = OrderedDict()
    optimizer._optimizer_load_state_dict_post_hooks = OrderedDict()
    optimizer._patch_step_function()   # wraps type(optimizer).step once: global + instance step hooks
    optimizer._warned_capturable_if_run_uncaptured = True


def run_state_dict_hooks(optimizer: torch.optim.Optimizer, build: Callable[[], dict]) -> dict:
    """``build()`` between the state-dict pre hooks and the post hooks (which may replace it)."""
    for pre_hook in optimizer._optimizer_state_dict_pre_hooks.values():
        pre_hook(optimizer)
    state_dict = build()
    for post_hook in optimizer._optimizer_state_dict_post_hooks.values():
        result = post_hook(optimizer, state_dict)
        if result is not None:
            state_dict = result
    return state_dict


def run_load_state_dict_hooks(optimizer: torch.optim.Optimizer, state_dict: dict,
                              load: Callable[[dict], None]) -> None:
    """``load`` on a shallow copy of ``state_dict`` after the pre hooks (which may replace it)."""
    state_dict = state_dict.copy()   # as torch: the caller's top-level dict is never changed
    for pre_hook in optimizer._optimizer_load_state_dict_pre_hooks.values():
        result = pre_hook(optimizer, state_dict)
        if result is not None:
            state_dict = result
    load(state_dict)
    for post_hook in optimizer._optimizer_load_state_dict_post_hooks.values():
        post_hook(optimizer)


def split_non_param_state(state_dict: dict, names: set[str]) -> tuple[dict, dict]:
    """``(state_dict without them, {key: value})`` for the ``state`` keys that stand for no param:
    keys in no saved group's ``params`` that are neither an index (int) nor one of ``names`` (the
    params' FQNs). ``Optimizer.load_state_dict`` keeps such keys in ``state`` as they are
    (``state["note"] = 1``); state of an index or FQN in no group stays, for the caller to refuse."""
    state, groups = state_dict.get("state"), state_dict.get("param_groups")
    if not isinstance(state, dict) or not isinstance(groups, list):
        return state_dict, {}
    in_groups = {key for group in groups if isinstance(group, dict)
                 for key in group.get("params", ()) if not isinstance(key, torch.Tensor)}
    others = {key: value for key, value in state.items()
              if key not in in_groups and not isinstance(key, int) and key not in names}
    if not others:
        return state_dict, {}
    return {**state_dict, "state": {k: v for k, v in state.items() if k not in others}}, others


def pause_global_step_hooks() -> list | None:
    """Before the wrapper's leaves step: torch's global step hooks (``register_optimizer_step_pre_hook``
    and ``..._post_hook``) are to see no leaf step, so around one ``wrapper.step()`` they fire once, for the
    wrapper, as around a plain optimizer's step (a profiler or step counter sees one step). The leaves' own
    instance hooks still fire. torch's hooked ``step`` reads the two tables as module globals at call time,
    so they are swapped for empty ones; :func:`resume_global_step_hooks` puts them back. Returns what it
    took (``None``: no global hook, nothing done, the usual case). Handles keep pointing at the real tables,
    so a hook removed meanwhile (by a leaf's own hook) stays removed; one registered meanwhile is kept,
    though its handle, bound to the empty table, cannot remove it. Not thread-safe: another thread's
    optimizer stepping meanwhile would miss the global hooks too. (Two plain calls, not a context manager:
    torch 2.6's dynamo graph-breaks on entering a generator-based one, in every compiled step.)"""
    saved = [getattr(torch_optimizer, name) for name in _GLOBAL_HOOKS]
    if not any(saved):
        return None
    for name in _GLOBAL_HOOKS:
        setattr(torch_optimizer, name, OrderedDict())
    return saved


def resume_global_step_hooks(saved: list | None) -> None:
    """Undo :func:`pause_global_step_hooks` (given what it returned)."""
    if saved is None:
        return
    for name, table in zip(_GLOBAL_HOOKS, saved):
        table.update(getattr(torch_optimizer, name))
        setattr(torch_optimizer, name, table)
