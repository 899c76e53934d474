"""Tiny cases that prove the rank harness itself works (and fails when a rank fails)."""
import torch
import torch.distributed as dist


def all_reduce_sum(rank, world):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def raise_on_rank_one(rank, world):
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def echo_args(**args):
    """A single-process case for tests.support.run_case: returns its arguments."""
    return {"args": args}
