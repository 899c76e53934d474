"""What every check gets: this rank's device, a 1-D mesh over all ranks, data made the same everywhere."""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from .compare import Comparison

#: torch >= 2.7 can skip distribute_tensor's broadcast (src_data_rank=None); torch 2.6 has no such argument
_CAN_SKIP_BROADCAST = "src_data_rank" in inspect.signature(distribute_tensor).parameters

#: param shapes: even, uneven (7 rows on 2 or 8 ranks) and empty (1 row: nothing past rank 0) shards
SHAPES = ((16, 8), (7,), (1,), (5, 3))


@dataclass
class Context:
    rank: int
    world: int
    device: torch.device
    mesh: Any
    workdir: str
    #: set by the engine for a negative control: the check's comparison sees its result one ulp off
    planted: bool = False
    #: set by the engine: the patch whose ``self_test`` this check is (None for a standalone check)
    patch: Optional[str] = None

    def patch_state(self) -> str:
        """The state of :attr:`patch` in this rank now (a check verifies it only when ``applied``)."""
        import npu_fsdp_patches  # pylint: disable=import-outside-toplevel

        return {r["name"]: r for r in npu_fsdp_patches.status()}[self.patch]["state"]

    def comparison(self) -> Comparison:
        """A fresh comparer for this check (the engine's negative control rides on it)."""
        return Comparison(plant=self.planted)

    def tensor(self, seed: int, shape, dtype: torch.dtype = torch.float32, span: float = 3.0) -> torch.Tensor:
        """Identical on every rank (made on CPU from ``seed``): magnitudes 10**-span..1, random signs."""
        gen = torch.Generator().manual_seed(seed)
        magnitude = torch.pow(10.0, -span * torch.rand(shape, generator=gen))
        sign = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0)
        return (magnitude * sign).to(device=self.device, dtype=dtype)

    def grad(self, step: int, index: int, shape, dtype: torch.dtype) -> torch.Tensor:
        """Grads from far below one bf16 ulp of the params (1e-10) up to O(1)."""
        return self.tensor(10_000 * step + index, shape, dtype, span=10.0)

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """``full``, identical on every rank, as a Shard(0) DTensor over the mesh (:func:`distribute_same`)."""
        return distribute_same(full, self.mesh, [Shard(0)])


def distribute_same(full: torch.Tensor, mesh: Any, placements: list) -> DTensor:
    """``distribute_tensor`` of a tensor every rank already holds identically, with no collective: torch
    >= 2.7 cuts it (``src_data_rank=None``); on torch 2.6, whose ``distribute_tensor`` always scatters,
    each rank cuts its own piece, so a rank that stopped early after an error leaves none waiting."""
    if _CAN_SKIP_BROADCAST:
        return distribute_tensor(full, mesh, placements, src_data_rank=None)
    shape, offset = compute_local_shape_and_global_offset(full.shape, mesh, placements)
    piece = full[tuple(slice(start, start + size) for start, size in zip(offset, shape))]
    return DTensor.from_local(piece.clone(memory_format=torch.contiguous_format), mesh, placements,
                              shape=full.shape, stride=full.stride())
