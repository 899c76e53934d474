"""Patch ``te_multi_tensor_apply_empty_tail``: a rank whose last tensor is empty never steps.

TE's CUDA launcher flushes its pending batch at the last chunk of the last tensor. A zero-numel
tensor has no chunk, so when the last tensor of a call is empty (an empty local shard at the end of a
param group, common with FSDP2 on uneven params) nothing pending is launched and the rank's params
silently stay as they were. This patch drops zero-numel slots in front of the installed
``MultiTensorApply.__call__``, as upstream's fix does, and calls the original with the remaining
slots. Upstream's fix and the releases: compat_matrix.yaml, docs/patches.md.
"""
from __future__ import annotations

from npu_fsdp_patches.patch import Patch, unpatched

_MODULE = "transformer_engine.pytorch.optimizers.multi_tensor_apply"


def _numel(t) -> int:
    from npu_fsdp_patches.optim.tensors import is_torch_dtensor
    return (t._local_tensor if is_torch_dtensor(t) else t).numel()


def _call(original):
    def __call__(self, op, noop_flag_buffer, tensor_lists, *args):
        keep = [_numel(t) > 0 for t in tensor_lists[0]]
        if all(keep):
            return original(self, op, noop_flag_buffer, tensor_lists, *args)
        if any(len(ts) != len(keep) for ts in tensor_lists):
            raise RuntimeError("Expected aligned multi-tensor lists.")
        kept = [[t for t, k in zip(ts, keep) if k] for ts in tensor_lists]
        if not kept[0]:
            return None
        return original(self, op, noop_flag_buffer, kept, *args)
    return __call__


class TeMultiTensorApplyEmptyTail(Patch):
    """`MultiTensorApply.__call__` drops zero-numel slots, as upstream's own fix does, before calling the
    release's `__call__`, so a rank whose last tensor is an empty local shard still launches the kernel
    on its other tensors."""

    name = "te_multi_tensor_apply_empty_tail"
    factories = {"__call__": _call}

    def upstream_skips_empty(self) -> bool:
        """True when the installed ``MultiTensorApply`` already keeps empty tensors from the kernel.

        Runs the unpatched ``__call__`` with a recording op on ``[ones(1), empty(0)]``: the fix
        hands the op only the non-empty tensor.
        """
        import importlib

        import torch
        cls = importlib.import_module(_MODULE).MultiTensorApply
        seen: list = []
        unpatched(cls.__dict__["__call__"])(
            cls(1), lambda _chunk, _flag, lists, *a: seen.append([t.numel() for t in lists[0]]),
            None, [[torch.ones(1), torch.empty(0)]])
        return seen in ([[1]], [])
