"""Writes to the model params between steps, found and honoured (docs/main_params.md#contract-with-torch-code).

A plain optimizer steps the params as they are, so a rewind (``model.load_state_dict(snapshot)``), weight
clipping (``p.clamp_()`` under ``no_grad``) or ``p.data = t`` between two steps is kept. A main-params
wrapper steps its fp32 main params and copies them over the model, which would undo such a write. So the
wrapper re-derives a main param from its model param before a step, element by element: where the model
param no longer equals its main param rounded to the model's dtype (bit for bit), the main param takes the
model's value and that element's fp32 tail is given up; elements the write left equal keep their tails
(a checkpoint reload that writes the same values loses nothing).

Comparing every element every step would cost a pass over the model, so eager steps compare only params
whose versions or memory moved since the wrapper last wrote them: the param's version counter (torch bumps
it on every in-place write through the param or a view of it, ``copy_`` from ``load_state_dict`` included),
a DTensor's local shard's version, and the memory the param holds (``p.data = t`` swaps a plain param's
storage and keeps the version). Weak references hold the recorded storages and shards, so a new one cannot
reuse the address of one that was freed. Not seen this way: in-place writes through ``p.data``, which torch
gives a version counter of its own. Inside a ``torch.compile`` graph a version cannot be read, so a compiled
step compares every param by value, in its graph.
"""
from __future__ import annotations

import weakref
from typing import Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ._rollback import Rollback
from .tensors import local_tensor, local_tensors

__all__ = ["ModelWrites", "written_elements", "rederive_from_model", "check_layouts", "adopt_written"]

#: the model dtypes the comparison knows (a bf16/fp16 param; fp32 after ``p.data = t.float()``)
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _versions(models: list[torch.Tensor], locals_: list[torch.Tensor]) -> list:
    """Each param's version and, for a DTensor, its local shard's too: the wrapper's counter moves on writes
    through the DTensor (``p.clamp_()``, ``copy_`` from ``load_state_dict``), the shard's on writes to it
    (``p.to_local().zero_()``, the wrapper's own copy back), which run below autograd for the other."""
    return [p._version if p is local else (p._version, local._version) for p, local in zip(models, locals_)]


def _holder(p: torch.Tensor, local: torch.Tensor) -> tuple:
    """What identifies the memory ``p`` holds: a plain param's storage (``p.data = t`` swaps it and keeps the
    version), held by a weak reference so that a freed storage's address cannot come back under another; a
    DTensor's local shard object (torch's ``p.data = t`` keeps it; FSDP2 may swap it for a view of its own)."""
    if p is local:
        storage = p.untyped_storage()
        return storage._cdata, StorageWeakRef(storage)
    return id(local), weakref.ref(local)


def _same_holder(p: torch.Tensor, local: torch.Tensor, held: tuple) -> bool:
    return p.untyped_storage()._cdata == held[0] if p is local else held[1]() is local


class ModelWrites:
    """The model params' versions and memory as the wrapper last left them, and which ones moved since."""

    def __init__(self, models: list[torch.Tensor]) -> None:
        self._versions: list = []
        self._holders: list[tuple] = []
        self.record(models)

    def record(self, models: list[torch.Tensor], indices: list[int] | None = None) -> None:
        """Take the versions and memory of ``models`` (or of ``models[i]`` for ``i`` in ``indices``) as ours."""
        locals_ = local_tensors(models)
        if indices is None:
            self._versions = _versions(models, locals_)
            self._holders = [_holder(p, local) for p, local in zip(models, locals_)]
            return
        for i in indices:
            self._versions[i] = _versions([models[i]], [locals_[i]])[0]
            self._holders[i] = _holder(models[i], locals_[i])

    def grown(self, models: list[torch.Tensor]) -> "ModelWrites":
        """A copy that also tracks ``models[len(tracked):]`` (params a new group added) from their current
        state; the records of the params tracked before are kept, so their pending writes are still seen."""
        grown = ModelWrites(models[len(self._versions):])
        grown._versions = self._versions + grown._versions
        grown._holders = self._holders + grown._holders
        return grown

    def record_versions(self, models: list[torch.Tensor]) -> None:
        """After the wrapper's own copy back (which moves versions, never memory): one cheap pass."""
        self._versions = _versions(models, local_tensors(models))

    def saved(self) -> tuple:
        """What :meth:`restore` puts back (a call that records, then fails, undoes its records)."""
        return list(self._versions), list(self._holders)

    def restore(self, saved: tuple) -> None:
        self._versions, self._holders = list(saved[0]), list(saved[1])

    def moved(self, models: list[torch.Tensor]) -> list[int]:
        """Indices of the params written since they were recorded."""
        locals_ = local_tensors(models)
        versions = _versions(models, locals_)
        same = [_same_holder(p, local, held) for p, local, held in zip(models, locals_, self._holders)]
        if versions == self._versions and all(same):
            return []
        return [i for i, (v, old, kept) in enumerate(zip(versions, self._versions, same)) if v != old or not kept]


def written_elements(main: torch.Tensor, model: torch.Tensor) -> torch.Tensor:
    """Where ``model`` differs, bit for bit, from fp32 ``main`` rounded to nearest even in the model's dtype
    (local shards). Both sides are compared as fp32 bit patterns (a bf16/fp16 value widens to fp32 exactly),
    the rounding done on ``main``'s bits with int32 ops: not ``main.to(model.dtype)``, which inductor keeps in
    fp32 inside a fused kernel (it does not emulate precision casts), and no bitcast of a bf16/fp16 tensor,
    which stops inductor's CPU kernel from vectorizing (the compiled step took 10 times as long). Checked
    against torch's casts: tests/test_main_params_model_writes.py."""
    widened = model.to(torch.float32).view(torch.int32)
    b = main.view(torch.int32)
    if model.dtype == torch.float32:
        return b != widened
    if model.dtype == torch.bfloat16:   # bf16 is fp32's upper half: round away the lower 16 bits
        return ((b + (0x7FFF + ((b >> 16) & 1))) & -65536) != widened
    # fp16: 10 mantissa bits where fp16 is normal, a fixed spacing of 2^-24 below 2^-14, inf from 65520 on
    rounded = ((b + (0xFFF + ((b >> 13) & 1))) & -8192).view(torch.float32)
    rounded = torch.where(main.abs() < 2.0 ** -14, torch.round(main * 2.0 ** 24) * 2.0 ** -24, rounded)
    rounded = torch.where(rounded.abs() > 65504.0, torch.where(main < 0, -float("inf"), float("inf")), rounded)
    return rounded.view(torch.int32) != widened


@torch.no_grad()
def rederive_from_model(main: torch.Tensor, model: torch.Tensor) -> None:
    """Main param (local shard) := the model's value where the model was written, its own value elsewhere.
    Traceable: no data-dependent Python branch (a compiled step runs it on every param)."""
    main.copy_(torch.where(written_elements(main, model), model.to(main.dtype), main))


def check_layouts(pairs: list[tuple[torch.Tensor, torch.Tensor]], name: Callable[[torch.Tensor], str]) -> None:
    """Refuse, before any write, a model param whose local shard no longer fits its main param
    (``p.data = t`` with another shape or device): the wrapper cannot step a param it no longer matches."""
    for model, main in pairs:
        model_l, main_l = local_tensor(model), local_tensor(main)
        if model_l.shape != main_l.shape or model_l.device != main_l.device or model_l.dtype not in _DTYPES:
            raise ValueError(
                f"model param {name(model)!r} was replaced by a {model_l.dtype} tensor of shape "
                f"{tuple(model_l.shape)} on {model_l.device} (p.data = ...?), but its fp32 main param has shape "
                f"{tuple(main_l.shape)} on {main_l.device}: a main-params wrapper cannot step it. Give the param "
                f"a bf16, fp16 or fp32 tensor of its original shape and device, or build a new optimizer and "
                f"wrapper for the changed model")


def adopt_written(pairs: list[tuple[torch.Tensor, torch.Tensor]], name: Callable[[torch.Tensor], str]) -> None:
    """Eager: re-derive the main params of ``pairs`` (model params whose versions or memory moved) from their model
    params. Every check runs first; a failure midway puts the main params back (docs/design.md#37)."""
    check_layouts(pairs, name)
    locals_ = [(local_tensor(model), local_tensor(main)) for model, main in pairs]
    written = [written_elements(main_l, model_l) for model_l, main_l in locals_]
    changed = [(model_l, main_l, w) for (model_l, main_l), w in zip(locals_, written) if bool(w.any())]
    rollback = Rollback()
    for _, main_l, _ in changed:
        rollback.tensor(main_l)
    try:
        with torch.no_grad():
            for model_l, main_l, w in changed:
                main_l.copy_(torch.where(w, model_l.to(main_l.dtype), main_l))
    except BaseException:
        rollback.restore()
        raise
