"""The optimizer state in the layout of hyper-parallel's own fp32 main-param wrapper over several
leaf optimizers (Muon + AdamW), from a torch-DTensor or plain model (docs/main_params.md#21).

``MainParamsOptimizer.state_dict()`` already loads into upstream's wrapper over one leaf. Over a
``ChainedOptimizer`` of several leaves, upstream's ``load_state_dict`` reads torch's flattened
FQN layout (``ChainedOptimizer(flatten=True)``) with the fp32 main params only in its section
(``_mixed_precision_optimizer.fp32_from_fp16_params.<FQN>``); this builds exactly that.
"""
from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from ._leaf_views import MAIN_PARAM
from ._main_params_state import MAIN_PARAMS_KEY, MP_KEY
from .main_params import MainParamsOptimizer
from .tensors import is_foreign_dtensor

__all__ = ["upstream_state_dict"]


def upstream_state_dict(model: nn.Module, optimizer: MainParamsOptimizer) -> dict[str, Any]:
    """torch's flattened state dict of ``optimizer`` (``state.<FQN>.<key>``, ``param_groups.<FQN>.<key>``)
    with each ``main_param`` moved into the RFC section: what hyper-parallel's
    ``Float16OptimizerWithFloat16Params`` over a chained Muon + AdamW optimizer loads with no fallback.
    The main params are the live tensors (no copy). Not for hyper-parallel DTensors, which torch's
    state-dict API cannot handle: there ``optimizer.state_dict()`` is upstream's layout already."""
    if not isinstance(optimizer, MainParamsOptimizer):
        raise TypeError(f"upstream_state_dict: expected a MainParamsOptimizer, got {type(optimizer).__name__}")
    foreign = [name for name, p in model.named_parameters() if is_foreign_dtensor(p)]
    if foreign:
        raise TypeError(f"upstream_state_dict: {foreign[0]} is a hyper-parallel DTensor; torch's state-dict "
                        f"API cannot read it, and optimizer.state_dict() is upstream's layout there already")
    flat = get_optimizer_state_dict(model, optimizer,
                                    options=StateDictOptions(flatten_optimizer_state_dict=True))
    suffix = f".{MAIN_PARAM}"
    mains = {key[len("state."):-len(suffix)]: flat.pop(key)
             for key in list(flat) if key.startswith("state.") and key.endswith(suffix)}
    return {**flat, MP_KEY: {MAIN_PARAMS_KEY: mains}}
