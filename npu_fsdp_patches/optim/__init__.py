"""Device-agnostic optimizer numerics behind the framework patches (needs torch).

Names resolve lazily so that ``import npu_fsdp_patches.optim`` stays cheap and each
implementation module imports torch only when it is used.
"""
from importlib import import_module
from typing import Any

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
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return __all__
