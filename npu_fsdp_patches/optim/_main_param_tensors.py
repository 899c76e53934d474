"""The tensors a main-params wrapper makes: fp32 main params, fp32 grads, cleared grads.

Copies go local shard to local shard, so no collective is added and hyper-parallel DTensors (whose
ops fail outside ``SkipDTensorDispatch``) are never dispatched on.
"""
from __future__ import annotations

import torch
from torch import nn

from .tensors import is_foreign_dtensor, is_torch_dtensor, local_tensor

__all__ = ["fp32_main_param", "fp32_grad", "clear_grads", "released_grads", "zero_grad_like"]

#: main params and their grads are contiguous on every rank: torch's fused optimizer kernels pair
#: param, grad and state elements by memory position, so a leaf AdamW(fused=True) needs one layout
_CONTIGUOUS_FP32 = dict(dtype=torch.float32, memory_format=torch.contiguous_format)


def fp32_main_param(p: torch.Tensor) -> nn.Parameter:
    """A new contiguous fp32 Parameter with ``p``'s values and DTensor layout (local shard copied,
    never gathered)."""
    if is_foreign_dtensor(p):
        # nn.Parameter(dt) would call dt.detach(), an op hyper-parallel dispatches (and refuses
        # outside SkipDTensorDispatch). Build the leaf on the local shard instead, wrap it (the
        # wrapper takes requires_grad from it), and flag it as nn.Parameter does for subclasses.
        local = local_tensor(p).detach().to(copy=True, **_CONTIGUOUS_FP32).requires_grad_(p.requires_grad)
        main = type(p).from_local(local, p.device_mesh, p.placements)
        main._is_param = True   # isinstance(main, nn.Parameter), see torch.nn.parameter._ParameterMeta
        return main
    if is_torch_dtensor(p):   # copy the local shard: no DTensor dispatch, no collective
        local = local_tensor(p).detach().to(copy=True, **_CONTIGUOUS_FP32)
        main = type(p).from_local(local, p.device_mesh, p.placements, run_check=False,
                                  shape=p.shape, stride=p.stride())
        return nn.Parameter(main, requires_grad=p.requires_grad)
    return nn.Parameter(p.detach().to(copy=True, **_CONTIGUOUS_FP32), requires_grad=p.requires_grad)


def fp32_grad(grad: torch.Tensor, like: torch.Tensor, layout: tuple | None = None) -> torch.Tensor:
    """``grad`` as a local shard of ``like``'s dtype and layout (``like`` is the main param it is for:
    fp32 for a bf16/fp16 param; a float64 or complex param is its own), with its DTensor layout kept; a
    grad that already has them is returned as is (no copy).

    The layout matters: torch's fused optimizer kernels pair param, grad and state elements by memory
    position, so a grad strided unlike its param would be stepped against the wrong elements.
    ``layout``: the torch DTensor's global ``(shape, stride)`` as ints, when the caller knows it (under
    ``torch.compile`` a traced DTensor's ``stride()`` is symbolic, which ``DTensor.from_local`` cannot take)."""
    dtype = like.dtype
    if grad.is_sparse:   # a sparse grad stays sparse, as the leaf gets it on a plain optimizer
        return grad.to(dtype)
    local, target = local_tensor(grad), local_tensor(like)
    if grad.dtype == dtype and local.stride() == target.stride():
        return grad
    if local.shape == target.shape:
        cast = torch.empty_like(target)
        cast.copy_(local)
    else:   # a wrong shape is the leaf optimizer's to refuse; never broadcast it here
        cast = local.to(dtype=dtype, memory_format=torch.contiguous_format)
    if is_foreign_dtensor(grad):
        return type(grad).from_local(cast, grad.device_mesh, grad.placements)
    if is_torch_dtensor(grad):   # cast the local shard: skips DTensor dispatch, adds no collective
        shape, stride = layout if layout is not None else (grad.shape, grad.stride())
        return type(grad).from_local(cast, grad.device_mesh, grad.placements,
                                     run_check=False, shape=shape, stride=stride)
    return cast


def clear_grads(p: torch.Tensor, set_to_none: bool) -> None:
    for attr in ("grad", "main_grad"):
        value = getattr(p, attr, None)
        if value is None:
            continue
        if set_to_none:
            setattr(p, attr, None)
        else:
            with torch.no_grad():
                local_tensor(value).zero_()
    if hasattr(p, "grad_added_to_main_grad"):
        p.grad_added_to_main_grad = False


def released_grads(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.dtype | None]:
    """The dtype of each model param's ``grad`` (None: no grad), taken before a step moves them to the main params."""
    return [None if model.grad is None else model.grad.dtype for model, _ in pairs]


def zero_grad_like(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A zero grad of ``dtype`` laid out like ``p`` (its DTensor layout kept, built on the local shard: no
    DTensor dispatch, which hyper-parallel refuses outside ``SkipDTensorDispatch``)."""
    local = torch.zeros_like(local_tensor(p), dtype=dtype)
    if is_foreign_dtensor(p):
        return type(p).from_local(local, p.device_mesh, p.placements)
    if is_torch_dtensor(p):
        return type(p).from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride())
    return local
