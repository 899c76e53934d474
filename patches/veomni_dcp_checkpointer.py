"""Patch ``veomni_dcp_refuse_main_params``: veomni's ``DistributedCheckpointer`` refuses a
``MainParamsOptimizer`` up front, naming the route, instead of failing half-way.

veomni's ``OptimizerState`` hands a single (non-``MultiOptimizer``) optimizer to torch's
``get_optimizer_state_dict``/``set_optimizer_state_dict`` (veomni 0.1.12
``veomni/checkpoint/dcp_checkpointer.py`` L316 and L345). Those map optimizer params to model FQNs
by identity (torch 2.13 ``torch/distributed/checkpoint/state_dict.py`` L960, ``_get_optim_state_dict``), and
the fp32 main params of a ``MainParamsOptimizer`` are not model params: saving raises
``KeyError '<fqn>'`` inside ``dcp.save``, after ``save`` has already created the checkpoint
directory and written ``extra_state`` (L631, L634). torch's API offers no hook to refuse earlier:
its first call on the optimizer, ``_init_optim_state``, may step it, and ``state_dict()`` cannot
tell its caller. So ``DistributedCheckpointer.save`` and ``load`` refuse such an optimizer before
anything is written or loaded; every other call goes to veomni's original untouched.
The route is ``npu_fsdp_patches.optim.save_checkpoint``/``load_checkpoint``.
"""
from __future__ import annotations

import functools
from typing import Any

from npu_fsdp_patches.patch import Patch


def main_params_refusal(action: str, path: Any, optimizer: Any) -> TypeError:
    """The error for ``DistributedCheckpointer.<action>`` handed a MainParamsOptimizer."""
    cls = type(optimizer)
    done = "nothing was written to" if action == "save" else "nothing was loaded from"
    return TypeError(
        f"veomni DistributedCheckpointer.{action} cannot checkpoint the optimizer "
        f"{cls.__module__}.{cls.__name__}: its fp32 main params are not model parameters, so torch "
        f"DCP's get_optimizer_state_dict/set_optimizer_state_dict, which veomni's OptimizerState "
        f"calls, cannot map them to model FQNs; {done} {str(path)!r}. Use "
        f"npu_fsdp_patches.optim.save_checkpoint(path, model, optimizer) and "
        f"load_checkpoint(path, model, optimizer) instead (they save the fp32 main params with DCP), "
        f"and keep veomni's extra_state (lr scheduler, dataloader, RNG) yourself")


def _is_main_params_optimizer(state: Any) -> bool:
    optimizer = state.get("optimizer") if isinstance(state, dict) else None
    if optimizer is None:
        return False
    from npu_fsdp_patches.optim.main_params import MainParamsOptimizer  # pylint: disable=C0415
    return isinstance(optimizer, MainParamsOptimizer)


def _refusing(action: str, original: Any) -> classmethod:
    """``DistributedCheckpointer.<action>`` (a classmethod) refusing a MainParamsOptimizer."""
    if not isinstance(original, classmethod):
        raise TypeError(f"veomni DistributedCheckpointer.{action} is {type(original).__name__}, "
                        f"not the classmethod this patch wraps")
    function = original.__func__

    def entry(cls, path, state, *args, **kwargs):
        if _is_main_params_optimizer(state):
            raise main_params_refusal(action, path, state["optimizer"])
        return function(cls, path, state, *args, **kwargs)

    return classmethod(entry)


class VeomniDcpRefuseMainParams(Patch):
    name = "veomni_dcp_refuse_main_params"
    factories = {"save": functools.partial(_refusing, "save"),
                 "load": functools.partial(_refusing, "load")}
