"""Undo records for validate-then-commit calls (docs/design.md#validate-then-commit).

Every check of a call runs before its first write; what can still fail midway (a copy, torch's own
``load_state_dict``, a hook of the user's) is undone from these records. Containers and attribute
dicts are recorded shallowly and restored *in place*, so every object keeps its identity and order;
tensors the call overwrites are cloned first (a transient copy, freed when the call returns).
Restoring calls the base types' own methods (``dict.clear``, ``list.__setitem__``,
``TensorBase.copy_``), so no override on a subclass (a user's state dict class) can fail it halfway.

A view (a wrapper optimizer's ``state``, ``param_groups``, a group or ``defaults``: ``._leaf_views``)
holds nothing itself; it names the containers it writes through to (``rollback_targets()``), and those
are recorded instead. So an optimizer handed over may itself be a wrapper: its leaves are recorded.
Anything else that is no dict or list is refused when recorded, before the call's first write.
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

    def container(self, c: Any) -> None:
        """A dict, a list, or a view of them (recorded through its ``rollback_targets()``)."""
        targets = getattr(type(c), "rollback_targets", None)
        if targets is not None:
            for target in c.rollback_targets():
                self.container(target)
        elif isinstance(c, dict):
            self.dict(c)
        elif isinstance(c, list):
            self.list(c)
        else:
            raise TypeError(f"cannot record a {type(c).__name__} for rollback: it is no dict, list or "
                            f"view of them")

    def dict(self, d: dict) -> None:
        if not isinstance(d, dict) or hasattr(type(d), "rollback_targets"):
            self.container(d)
            return
        items = list(d.items())

        def undo() -> None:
            dict.clear(d)
            dict.update(d, items)
        self._undo.append(undo)

    def list(self, items: list) -> None:
        if not isinstance(items, list) or hasattr(type(items), "rollback_targets"):
            self.container(items)
            return
        saved = list(items)
        self._undo.append(lambda: list.__setitem__(items, slice(None), saved))

    def attrs(self, obj: Any) -> None:
        """``obj.__dict__`` (attributes the call may set, replace or delete)."""
        self.dict(vars(obj))

    def optimizer(self, opt: torch.optim.Optimizer) -> None:
        """An optimizer's attributes, ``state`` and each param's state dict, ``defaults``, its group
        dicts and their ``params``; a wrapper's leaf optimizers too (its views are recorded through
        what they show)."""
        self.attrs(opt)
        for leaf in vars(opt).get("leaf_optimizers") or ():
            if leaf is not opt:
                self.optimizer(leaf)
        self.container(opt.state)
        if not hasattr(type(opt.state), "rollback_targets"):
            for entry in list(opt.state.values()):
                if isinstance(entry, dict):
                    self.dict(entry)
        self.container(opt.defaults)
        self.container(opt.param_groups)
        for group in opt.param_groups:
            self.container(group)
            if not hasattr(type(group), "rollback_targets"):
                self.container(group["params"])

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
