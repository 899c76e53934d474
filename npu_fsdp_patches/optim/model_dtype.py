"""Trainer-config check and model dtype cast for fp32 main params (docs/hyper_parallel.md#rfc-001-5-config,
#rfc-001-6-model-dtype).

``validate_fp32_main_params_config`` runs before any model is built: fp32 main params need fp32
gradient reduction, and the config is never rewritten to get it. ``apply_model_init_dtype`` casts
a built (possibly FSDP-sharded) model to ``model_init_dtype`` without replacing any Parameter,
so optimizer param routing, sharing and DTensor layouts stay valid.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from .tensors import is_any_dtensor, is_foreign_dtensor, local_tensor

_DTYPES = {"float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float32": torch.float32, "fp32": torch.float32, "float": torch.float32}


def _get(node: Any, key: str) -> Any:
    if node is None:
        return None
    if isinstance(node, Mapping):
        return node.get(key)
    return getattr(node, key, None)


def _as_dtype(value: Any, what: str) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value.lower().removeprefix("torch.") in _DTYPES:
        return _DTYPES[value.lower().removeprefix("torch.")]
    raise ValueError(f"{what}={value!r} is not a dtype; use float16, bfloat16, float32 or null")


def fp32_main_params_enabled(config: Any) -> bool:
    """``optimizer.fp32_main_params`` of a trainer config (mapping or attribute object); the one reader."""
    return bool(_get(_get(config, "optimizer"), "fp32_main_params"))


def validate_fp32_main_params_config(config: Any) -> None:
    """Raise ``ValueError`` when ``optimizer.fp32_main_params`` is on without fp32 reduction.

    ``config`` is the trainer config as a mapping (or attribute object). The error names both
    ``optimizer.fp32_main_params`` and ``fsdp_config.mix_precision.reduce_dtype``.
    """
    if not fp32_main_params_enabled(config):
        return
    reduce_dtype = _get(_get(_get(config, "fsdp_config"), "mix_precision"), "reduce_dtype")
    try:
        ok = _as_dtype(reduce_dtype, "fsdp_config.mix_precision.reduce_dtype") == torch.float32
    except ValueError:
        ok = False
    if not ok:
        found = "is not set" if reduce_dtype is None else f"is {reduce_dtype!r}"
        raise ValueError(
            f"optimizer.fp32_main_params=true requires fsdp_config.mix_precision.reduce_dtype="
            f"'float32', but fsdp_config.mix_precision.reduce_dtype {found}; set it explicitly "
            f"(it is never filled in automatically)")


def _layout(t: torch.Tensor) -> tuple | None:
    """Mesh and placements, compared by value: torch's sharding-propagation cache may hand a cast
    DTensor an equal mesh object created earlier (DeviceMesh defines ``==``; a mesh type without it
    compares by identity)."""
    if not is_any_dtensor(t):
        return None
    return (t.device_mesh, tuple(t.placements))


def _refuse_foreign_casts(model: nn.Module, dtype: torch.dtype) -> None:
    """Refuse, before anything is cast, a model whose DTensors of another framework (hyper-parallel's)
    would need a cast. Their ops run only through that framework's dispatch, and its ``fully_shard``
    records each param's dtype and sharded storage when it shards (hyper-parallel fdd0a808
    platform/torch/fully_shard/state.py:58, param.py:289-297), so a cast afterwards would not reach what
    it all-gathers: training would go on with the old weights. Cast before sharding instead."""
    leaves = dict((*model.named_parameters(), *model.named_buffers()))
    names = [name for name, t in leaves.items() if is_foreign_dtensor(t)
             and local_tensor(t).is_floating_point() and local_tensor(t).dtype != dtype]
    if not names:
        return
    first = leaves[names[0]]
    shown = ", ".join(repr(n) for n in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    raise TypeError(
        f"apply_model_init_dtype: {shown} {'is a' if len(names) == 1 else 'are'} "
        f"{type(first).__module__}.{type(first).__qualname__} ({local_tensor(first).dtype}), the DTensor of "
        "a framework that shards with its own fully_shard and records each param's dtype when it shards: "
        "a cast afterwards would not reach its sharded storage. Cast the model first, then shard it: "
        f"apply_model_init_dtype(model, {str(dtype).removeprefix('torch.')!r}) before fully_shard(model, ...). "
        "Nothing was cast")


def _cast_plain_leaves(model: nn.Module, dtype: torch.dtype) -> None:
    """Module.to(dtype) for the plain floating params and buffers of a model that also holds foreign
    DTensors already in ``dtype`` (they are left alone)."""
    with torch.no_grad():
        for t in (*model.parameters(), *model.buffers()):
            if not is_foreign_dtensor(t) and t.is_floating_point() and t.dtype != dtype:
                t.data = t.data.to(dtype)


def apply_model_init_dtype(model: nn.Module, dtype: Any) -> nn.Module:
    """Cast floating params and buffers of ``model`` to ``dtype`` in place (None: no-op).

    Integer and bool buffers are left alone. Parameter objects, and DTensor meshes and
    placements, are kept; this is checked afterwards and a violation raises ``RuntimeError``.
    FSDP2 modules refresh their padded shard storage through their own ``_apply`` hook, so with torch
    FSDP2 either order works. A DTensor of another framework (hyper-parallel's) that would need a cast
    is refused with ``TypeError`` before anything is cast: cast before that framework's ``fully_shard``.
    """
    dtype = _as_dtype(dtype, "model_init_dtype")
    if dtype is None:
        return model
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"model_init_dtype={dtype} is not one of float16, bfloat16, float32")
    _refuse_foreign_casts(model, dtype)
    before = {name: (p, _layout(p)) for name, p in model.named_parameters()}
    int_buffers = {name: (b, b.dtype) for name, b in model.named_buffers()
                   if not local_tensor(b).is_floating_point()}
    if any(is_foreign_dtensor(t) for t in (*model.parameters(), *model.buffers())):
        _cast_plain_leaves(model, dtype)   # Module.to would ask each foreign DTensor is_floating_point()
    else:
        model.to(dtype)   # Module.to(dtype) casts floating tensors only, via param.data = ...
    after = dict(model.named_parameters())
    for name, (p, layout) in before.items():
        if after.get(name) is not p:
            raise RuntimeError(f"apply_model_init_dtype replaced parameter {name!r}")
        if _layout(p) != layout:
            raise RuntimeError(f"apply_model_init_dtype changed the DTensor layout of {name!r}")
        if local_tensor(p).is_floating_point() and local_tensor(p).dtype != dtype:
            raise RuntimeError(f"parameter {name!r} is {local_tensor(p).dtype} after the cast to {dtype}")
    for name, b in model.named_buffers():
        if name in int_buffers and b.dtype != int_buffers[name][1]:
            raise RuntimeError(f"apply_model_init_dtype changed the dtype of buffer {name!r}")
        if local_tensor(b).is_floating_point() and local_tensor(b).dtype != dtype:
            raise RuntimeError(f"buffer {name!r} is {local_tensor(b).dtype} after the cast to {dtype}")
    return model
