"""Test-side shim for FSDP2 on CPU/gloo with older torch; installed only where a probe shows the
gap, only in rank processes (``tests/_rank_main.py``). The plugin never touches collectives.

FSDP2 reduce-scatters gradients with ``ReduceOp.AVG``, which gloo in older torch sums instead
  (docs/torch_adam.md#8-fsdp2-on-cpu). Where the probe sees that, AVG on gloo runs as SUM / group size.
"""
import functools

import torch
import torch.distributed as dist


def gloo_reduce_scatter_avg_sums() -> bool:
    """True when gloo's ``reduce_scatter_tensor(op=AVG)`` returns the sum (collective: all ranks)."""
    world = dist.get_world_size()
    out = torch.empty(1)
    dist.reduce_scatter_tensor(out, torch.ones(world), op=dist.ReduceOp.AVG)
    return world > 1 and out.item() != 1.0


def fix_gloo_reduce_scatter_avg() -> bool:
    """Run gloo ``reduce_scatter_tensor(op=AVG)`` as SUM then divide, where gloo sums for AVG."""
    if not gloo_reduce_scatter_avg_sums():
        return False
    original = dist.reduce_scatter_tensor

    @functools.wraps(original)
    def reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if op != dist.ReduceOp.AVG:
            return original(output, input, op=op, group=group, async_op=async_op)
        work = original(output, input, op=dist.ReduceOp.SUM, group=group, async_op=False)
        output.div_(dist.get_world_size(group))
        return work
    dist.reduce_scatter_tensor = reduce_scatter_tensor
    return True
