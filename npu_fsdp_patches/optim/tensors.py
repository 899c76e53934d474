"""Small tensor predicates shared by the optimizers: which DTensor flavour, and its local shard.

Two DTensor flavours exist: torch's ``torch.distributed.tensor.DTensor`` and hyper-parallel's
DTensor, which is a ``torch.Tensor`` subclass exposing ``to_local()``/``device_mesh``/``placements``
but is *not* a torch DTensor (docs/hyper_parallel.md#44-task-4-hyper-dtensor-api). Neither import
is required here: the torch class is looked up only if ``torch.distributed.tensor`` is loaded.
"""
from __future__ import annotations

import sys

import torch


def torch_dtensor_type():
    """torch's DTensor class, or None when torch.distributed.tensor has not been imported."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None) if module is not None else None


def is_torch_dtensor(t: object) -> bool:
    cls = torch_dtensor_type()
    return cls is not None and isinstance(t, cls)


def is_foreign_dtensor(t: object) -> bool:
    """A DTensor-like tensor that is not torch's own (e.g. hyper-parallel's)."""
    return (isinstance(t, torch.Tensor) and not is_torch_dtensor(t)
            and callable(getattr(t, "to_local", None)) and hasattr(t, "placements"))


def is_any_dtensor(t: object) -> bool:
    return is_torch_dtensor(t) or is_foreign_dtensor(t)


#: exact types that are plain tensors (no DTensor flavour), for fast type checks on hot paths
PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor of either flavour (no autograd hop), or ``t`` itself."""
    if type(t) in PLAIN_TYPES:   # fast path: optimizers call this per tensor on every step
        return t
    if is_torch_dtensor(t):
        return t._local_tensor
    if is_foreign_dtensor(t):
        return t.to_local()
    return t


def local_tensors(tensors) -> list:
    """``[local_tensor(t) for t in tensors]`` with torch's DTensor class looked up once: on hot paths
    over hundreds of params, the per-tensor lookup is most of the Python overhead."""
    dtensor = torch_dtensor_type()
    return [t if type(t) in PLAIN_TYPES else t._local_tensor if type(t) is dtensor else local_tensor(t)
            for t in tensors]


def contiguous_operands(lists: list, read_only: tuple = ()) -> tuple:
    """``lists`` with every non-contiguous tensor replaced by a contiguous copy, and the
    ``(original, copy)`` pairs to copy back after an in-place kernel (lists in ``read_only``
    are inputs only and get no pair).

    Why: torch's fused Adam kernels walk each tensor's memory from its data pointer and pair the
    elements of param, grad and states by memory position, so they compute wrong updates when the
    operands' layouts differ or leave gaps (the (4, 2) stride (3, 1) local shard of an uneven
    ``Shard(1)`` DTensor on torch 2.7.1, next to contiguous ``zeros_like`` states).
    """
    out = [list(tensors) for tensors in lists]
    pairs = []
    for k, tensors in enumerate(out):
        for i, t in enumerate(tensors):
            if not t.is_contiguous():
                tensors[i] = t.contiguous()
                if k not in read_only:
                    pairs.append((t, tensors[i]))
    return out, pairs


def copy_back(pairs: list) -> None:
    """Write the updated contiguous copies of :func:`contiguous_operands` into the originals."""
    for original, updated in pairs:
        original.copy_(updated)
