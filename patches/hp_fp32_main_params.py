"""hp_fp32_main_params: ``optimizer.fp32_main_params: true`` for hyper-parallel builds without the wrapper.

hyper-parallel later shipped ``Float16OptimizerWithFloat16Params``
(``hyper_parallel.components.optim.mixed_precision_optimizer``,
docs/hyper_parallel.md#15-upstream-fp32-wrapper) and a trainer that checks the config and wraps the optimizer
(docs/hyper_parallel.md#16-trainer). Older builds silently drop the key, so a bf16 model keeps losing small
updates. This patch routes the trainer into npu_fsdp_patches.optim:

* ``BaseTrainer.__init__``: ``validate_fp32_main_params_config`` before any model is built;
* ``BaseTrainer._build_optimizer``: wrap the built optimizer in ``MainParamsOptimizer``;
* ``BaseTrainer.save_checkpoint``/``load_checkpoint`` (optional targets): one DCP save in the layout
  hyper-parallel's own wrapper and DCP checkpointer write (the RFC section, FQN-keyed state flattened as
  its ``ChainedOptimizer`` flattens Muon + AdamW), so a run resumes under upstream's wrapper exactly;
  loading reads that layout and torch's, with the RFC 001 load branches
  (docs/hyper_parallel.md#rfc-001-9-checkpoints, docs/main_params.md).

It stands down where the upstream wrapper module exists. torch and the optim package are imported
inside the replacements only (the hook fires right after the trainer module is imported).
"""
from __future__ import annotations

import functools
import importlib.util
import inspect
import sys

from npu_fsdp_patches.patch import Patch

_UPSTREAM_MODULE = "hyper_parallel.components.optim.mixed_precision_optimizer"


_TRAINER_MODULES = ("hyper_parallel.trainer.base", "hyper_parallel.auto_models.trainer.base")


def _config_argument(original, args, kwargs):
    """The ``config`` the call passes (positional or keyword), bound by the original's own signature;
    None when the call does not bind (the original then raises its own TypeError)."""
    try:
        return inspect.signature(original).bind(None, *args, **kwargs).arguments.get("config")
    except TypeError:
        return None


def _init(original):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        config = _config_argument(original, args, kwargs)
        if config is not None:
            from npu_fsdp_patches.optim import validate_fp32_main_params_config
            validate_fp32_main_params_config(config)      # before the model is built; never rewrites
        return original(self, *args, **kwargs)
    return __init__


def _build_optimizer(original):
    @functools.wraps(original)
    def _build_optimizer(self, *args, **kwargs):
        optimizer = original(self, *args, **kwargs)
        config = getattr(self, "config", None)
        if config is None:     # not the config lineage: never an AttributeError the original lacks
            return optimizer
        from npu_fsdp_patches.optim.model_dtype import fp32_main_params_enabled
        if not fp32_main_params_enabled(config):
            return optimizer
        from npu_fsdp_patches.optim import MainParamsOptimizer
        return MainParamsOptimizer(optimizer, self.model)
    return _build_optimizer


def _routes_to_dcp(trainer) -> bool:
    """Our DCP checkpoint for a wrapped optimizer over torch-DTensor/plain params. A model of hyper
    DTensors stays on the trainer's own (hyper) checkpointer, which serializes the wrapper's
    ``state_dict`` (upstream's own layout there, docs/main_params.md §2.1); torch DCP cannot shard
    hyper DTensors."""
    from npu_fsdp_patches.optim import MainParamsOptimizer
    from npu_fsdp_patches.optim.tensors import is_foreign_dtensor
    return (isinstance(trainer.optimizer, MainParamsOptimizer)
            and not any(is_foreign_dtensor(p) for p in trainer.model.parameters()))


def _save_checkpoint(original):
    def save_checkpoint(self, path, *args, **kwargs):
        if not _routes_to_dcp(self):
            return original(self, path, *args, **kwargs)
        from npu_fsdp_patches.optim import save_checkpoint as save
        return save(path, self.model, self.optimizer, layout="upstream")   # what upstream's wrapper reads
    return save_checkpoint


def _load_checkpoint(original):
    def load_checkpoint(self, path, *args, **kwargs):
        if not _routes_to_dcp(self):
            return original(self, path, *args, **kwargs)
        from npu_fsdp_patches.optim import load_checkpoint as load
        return load(path, self.model, self.optimizer, load_optimizer=kwargs.get("load_optimizer", True))
    return load_checkpoint


class HpFp32MainParams(Patch):
    """`npu_fsdp_patches.optim.MainParamsOptimizer` gives every bf16/fp16 trainable param an fp32
    `main_param` (local shard to local shard), steps AdamW and Muon on them unchanged, and copies back;
    it reads `p.main_grad` when hyper writes one. At `hyper_parallel.trainer.base` (or the older
    `hyper_parallel.auto_models.trainer.base`), `BaseTrainer.__init__` validates the config before any
    model is built, `_build_optimizer` wraps the optimizer when `optimizer.fp32_main_params` is true,
    and the trainer's checkpoint save/load go through `save_checkpoint` (in the layout hyper-parallel's
    own wrapper and DCP checkpointer write, so upstream's wrapper resumes it exactly) and
    `load_checkpoint` (either layout)."""

    name = "hp_fp32_main_params"
    factories = {"__init__": _init, "_build_optimizer": _build_optimizer,
                 "save_checkpoint": _save_checkpoint, "load_checkpoint": _load_checkpoint}

    def upstream_has_wrapper(self) -> str:
        """The reason to stand down, or "" to wrap: upstream ships its FP32 wrapper, or the imported
        trainer is not the config-lineage ``BaseTrainer(config, ...)`` whose contract we know."""
        try:
            if importlib.util.find_spec(_UPSTREAM_MODULE) is not None:
                return f"upstream has it ({_UPSTREAM_MODULE})"
        except ModuleNotFoundError:   # a parent package is missing
            pass
        for name in _TRAINER_MODULES:
            module = sys.modules.get(name)
            if module is not None:
                reason = trainer_shape_problem(module)
                if reason:
                    return reason
        return ""


def trainer_shape_problem(module) -> str:
    """Why ``module``'s trainer is not the config lineage (``BaseTrainer.__init__(self, config, ...)``
    with ``_build_optimizer``); "" when it is. Decided by the target's signature, not its version."""
    if hasattr(module, "HyperTrainer"):
        return "unknown trainer shape: HyperTrainer (RFC hyper-parallel#726) has no known contract"
    trainer = getattr(module, "BaseTrainer", None)
    init = getattr(trainer, "__init__", None)
    if trainer is None or not callable(getattr(trainer, "_build_optimizer", None)):
        return "unknown trainer shape: no BaseTrainer._build_optimizer"
    try:
        params = list(inspect.signature(init).parameters)[1:2]
    except (TypeError, ValueError):
        params = []
    if params != ["config"]:
        return f"unknown trainer shape: BaseTrainer.__init__ takes {params or 'nothing'}, not config (args lineage)"
    return ""
