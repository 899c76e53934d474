"""A small model of free parameters, sharded with torch FSDP2, and grads cut as FSDP2 cuts them."""
from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

from .context import SHAPES, Context


class Params(nn.Module):
    """One parameter per shape of :data:`SHAPES` (magnitudes 1e-3..1: bf16 ulps differ widely)."""

    def __init__(self, ctx: Context, dtype: torch.dtype) -> None:
        super().__init__()
        for i, shape in enumerate(SHAPES):
            self.register_parameter(f"w{i}", nn.Parameter(ctx.tensor(500 + i, shape, dtype)))


def sharded_copies(ctx: Context, dtype: torch.dtype, count: int) -> list:
    """``count`` identical FSDP2-sharded models; returns their parameter lists."""
    base = Params(ctx, dtype)
    models = [copy.deepcopy(base) for _ in range(count)]
    for model in models:
        fully_shard(model, mesh=ctx.mesh)
    return [list(model.parameters()) for model in models]


def local_grad(ctx: Context, step: int, index: int, param: DTensor) -> torch.Tensor:
    """This rank's dim-0 chunk of the step's full grad, as FSDP2 / Shard(0) cut it (torch.chunk)."""
    whole = ctx.grad(step, index, param.shape, param.dtype)
    chunks = torch.chunk(whole, ctx.world, dim=0)
    return chunks[ctx.rank].clone() if ctx.rank < len(chunks) else whole[0:0].clone()


def set_dtensor_grads(ctx: Context, step: int, params: list) -> list:
    """Give every param its grad as a torch DTensor; returns the local chunks for other copies."""
    chunks = []
    for i, p in enumerate(params):
        chunk = local_grad(ctx, step, i, p)
        p.grad = DTensor.from_local(chunk, p.device_mesh, [Shard(0)], run_check=False, shape=p.shape,
                                    stride=p.stride())
        chunks.append(chunk)
    return chunks
