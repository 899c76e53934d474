"""DTensor helpers shared by the rank-side cases, working on every verified torch."""
import inspect

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

_HAS_SRC_DATA_RANK = "src_data_rank" in inspect.signature(distribute_tensor).parameters


def distribute_same(full, mesh, placements):
    """``distribute_tensor`` of a tensor every rank already holds identically, with no collective: where
    torch has ``src_data_rank`` (>= 2.7) torch cuts it; on torch 2.6 (whose ``distribute_tensor`` always
    scatters or broadcasts) each rank cuts its own piece, so a rank that stopped early after an error
    cannot leave the others waiting in a collective."""
    if _HAS_SRC_DATA_RANK:
        return distribute_tensor(full, mesh, placements, src_data_rank=None)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    shape, offset = compute_local_shape_and_global_offset(full.shape, mesh, placements)
    piece = full[tuple(slice(start, start + size) for start, size in zip(offset, shape))]
    return DTensor.from_local(piece.clone(memory_format=torch.contiguous_format), mesh, placements,
                              shape=full.shape, stride=full.stride())
