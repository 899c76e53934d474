"""The parts of ``torch.optim.Optimizer`` a wrapper optimizer that holds no params must set up itself.

``Optimizer.__init__`` needs a non-empty param list and assigns ``state``/``param_groups``, which a
wrapper exposes as views of its inner optimizers; so a wrapper cannot call it. Without what it
sets up, hooks registered on the wrapper are accepted and never fire. This module sets up the same
hook tables and step patch, and runs the state-dict hooks exactly as ``Optimizer.state_dict`` and
``Optimizer.load_state_dict`` do (torch/optim/optimizer.py).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import torch

__all__ = ["init_optimizer_contract", "run_state_dict_hooks", "run_load_state_dict_hooks"]


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
