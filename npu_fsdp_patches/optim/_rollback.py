"""Undo records for validate-then-commit calls (docs/design.md#validate-then-commit).

Every check of a call runs before its first write; what can still fail midway (a copy, torch's own
``load_state_dict``, a hook of the user's) is undone from these records. Containers and attribute
dicts are recorded shallowly and restored *in place*, so every object keeps its identity and order;
tensors the call overwrites are cloned first (a transient copy, freed when the call returns).
Restoring calls the base types' own methods (``dict.clear``, ``list.__setitem__``,
``TensorBase.copy_``), so no override on a subclass (a user's state dict class) can fail it halfway.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from .tensors import local_tensor

__all__ = ["Rollback"]


class Rollback:
    """Records taken before the first write; :meth:`restore` puts them back, newest first."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def dict(self, d: dict) -> None:
        items = list(d.items())

        def undo() -> None:
            dict.clear(d)
            dict.update(d, items)
        self._undo.append(undo)

    def list(self, items: list) -> None:
        saved = list(items)
        self._undo.append(lambda: list.__setitem__(items, slice(None), saved))

    def attrs(self, obj: Any) -> None:
        """``obj.__dict__`` (attributes the call may set, replace or delete)."""
        self.dict(vars(obj))

    def optimizer(self, opt: torch.optim.Optimizer) -> None:
        """An optimizer's attributes, ``state``, ``defaults``, its group dicts and their ``params``."""
        self.attrs(opt)
        self.dict(opt.state)
        self.dict(opt.defaults)
        self.list(opt.param_groups)
        for group in opt.param_groups:
            self.dict(group)
            self.list(group["params"])

    def tensor(self, t: torch.Tensor) -> None:
        """The data of ``t``'s local shard (cloned; no collective)."""
        local = local_tensor(t)
        saved = local.detach().clone()

        def undo() -> None:
            with torch.no_grad():
                torch._C.TensorBase.copy_(local, saved)
        self._undo.append(undo)

    def restore(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
