"""Device-agnostic optimizer numerics behind the framework patches (needs torch).

``import npu_fsdp_patches.optim`` imports no implementation module (and so no torch): each public
name below is imported from its module on first use. Only those names resolve that way; any other
name raises ``AttributeError`` at once and imports nothing, so ``hasattr`` and attribute walks
(doc tools, debuggers) cost nothing and load nothing they did not name.
"""
from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:   # the same names for type checkers and editors; never run
    from ._main_params_state import drop_main_params
    from .foreach_adamw import foreach_adamw_step
    from .fused_adam import FusedAdam
    from .main_params import Float16OptimizerWithFloat16Params, MainParamsOptimizer
    from .main_params_checkpoint import load_checkpoint, save_checkpoint
    from .model_dtype import apply_model_init_dtype, validate_fp32_main_params_config
    from .rebuild_main_params_planner import RebuildMainParamsPlanner
    from .muon_routing import OptimizerChain, build_muon_adamw, split_muon_adamw_params
    from .upstream_layout import upstream_state_dict

#: public name -> the module of this package that defines it
_EXPORTS = {
    "FusedAdam": "fused_adam",
    "foreach_adamw_step": "foreach_adamw",
    "MainParamsOptimizer": "main_params",
    "Float16OptimizerWithFloat16Params": "main_params",
    "save_checkpoint": "main_params_checkpoint",
    "load_checkpoint": "main_params_checkpoint",
    "drop_main_params": "_main_params_state",
    "validate_fp32_main_params_config": "model_dtype",
    "apply_model_init_dtype": "model_dtype",
    "build_muon_adamw": "muon_routing",
    "split_muon_adamw_params": "muon_routing",
    "OptimizerChain": "muon_routing",
    "upstream_state_dict": "upstream_layout",
    "RebuildMainParamsPlanner": "rebuild_main_params_planner",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{module}"), name)
    globals()[name] = value   # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
