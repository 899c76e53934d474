"""DTensor helpers shared by the rank-side cases, working on every verified torch."""
import inspect

from torch.distributed.tensor import distribute_tensor

_HAS_SRC_DATA_RANK = "src_data_rank" in inspect.signature(distribute_tensor).parameters


def distribute_same(full, mesh, placements):
    """``distribute_tensor`` of a tensor every rank already holds identically: no broadcast where
    torch has ``src_data_rank`` (>= 2.7); torch 2.6 broadcasts rank 0's copy, which is the same."""
    if _HAS_SRC_DATA_RANK:
        return distribute_tensor(full, mesh, placements, src_data_rank=None)
    return distribute_tensor(full, mesh, placements)
