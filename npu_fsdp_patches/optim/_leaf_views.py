"""Write-through views of a wrapper optimizer's leaf optimizers: ``state``, ``param_groups``, ``defaults``.

torch code handed an optimizer (LR schedulers, grad clipping, checkpoint helpers) reads *and
writes* these attributes. A wrapper that rebuilt a fresh dict or list on each access would drop
those writes silently. These views send every write to the leaf optimizer that owns the param,
and refuse, with an error saying what to do instead, any write that has no owner.
"""
from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any, Callable, Iterator

import torch

__all__ = ["LeafState", "LeafParamGroups", "ReadOnlyDefaults"]


class LeafState(MutableMapping):
    """``{param: state}`` across the leaf optimizers; reads and writes go to the owning leaf.

    Like a plain optimizer's ``state`` (a ``defaultdict(dict)``), reading a param that has no state
    yet creates its empty dict, in its leaf. A key that is no optimizer param is refused:
    ``describe(param)`` says why (e.g. that it is a model param whose state lives under its main
    param).
    """

    def __init__(self, leaves: list[torch.optim.Optimizer],
                 describe: Callable[[Any], str]) -> None:
        self._leaves = leaves
        self._describe = describe
        self._owner_by_id: dict[int, torch.optim.Optimizer] = {}

    def _owner(self, param: Any) -> torch.optim.Optimizer | None:
        leaf = self._owner_by_id.get(id(param))
        if leaf is None:   # first use, or a param added to a leaf after wrapping
            self._owner_by_id = {id(p): leaf for leaf in self._leaves
                                 for group in leaf.param_groups for p in group["params"]}
            leaf = self._owner_by_id.get(id(param))
        return leaf

    def _leaf_for_write(self, param: Any) -> torch.optim.Optimizer:
        leaf = self._owner(param)
        if leaf is None:
            raise KeyError(f"cannot use {self._describe(param)} as a key of the optimizer state: "
                           f"it is in no param group of the wrapped optimizers")
        return leaf

    def __getitem__(self, param: Any) -> Any:
        return self._leaf_for_write(param).state[param]

    def __setitem__(self, param: Any, value: Any) -> None:
        self._leaf_for_write(param).state[param] = value

    def __delitem__(self, param: Any) -> None:
        del self._leaf_for_write(param).state[param]

    def __contains__(self, param: object) -> bool:
        leaf = self._owner(param)
        return leaf is not None and param in leaf.state

    def get(self, param: Any, default: Any = None) -> Any:
        leaf = self._owner(param)
        return default if leaf is None else leaf.state.get(param, default)

    def __iter__(self) -> Iterator[Any]:
        for leaf in self._leaves:
            yield from list(leaf.state)

    def __len__(self) -> int:
        return sum(len(leaf.state) for leaf in self._leaves)

    def __repr__(self) -> str:
        return f"LeafState({len(self)} params over {len(self._leaves)} leaf optimizer(s))"


class LeafParamGroups(list):
    """The leaf optimizers' param-group dicts themselves, in leaf order.

    Entries of a group (``group["lr"] = ...``, as LR schedulers do) are written straight into the
    leaf's group. Adding, removing or replacing whole groups is refused: the wrapper's main params
    are made when it is built, so groups belong on the leaf optimizer before wrapping.
    """

    _REFUSAL = ("{owner}.param_groups is a view of the wrapped optimizers' param groups: edit a "
                "group's entries in place (group['lr'] = ...); add, remove or replace groups on the "
                "leaf optimizer before wrapping it")

    def __init__(self, leaves: list[torch.optim.Optimizer], owner: str) -> None:
        super().__init__(group for leaf in leaves for group in leaf.param_groups)
        self._owner_name = owner

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(self._REFUSAL.format(owner=self._owner_name))

    def __reduce_ex__(self, protocol: Any) -> tuple:
        return list, (list(self),)   # copies and pickles are plain lists of the same groups

    append = extend = insert = remove = pop = clear = sort = reverse = _refuse
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse


class ReadOnlyDefaults(Mapping):
    """The first leaf optimizer's ``defaults``, readable but not writable.

    Defaults only seed groups added later, and the wrapper takes no new groups, so a write here
    could never take effect: it is refused instead of being dropped.
    """

    def __init__(self, defaults: dict, owner: str) -> None:
        self._defaults = defaults
        self._owner_name = owner

    def __getitem__(self, key: str) -> Any:
        return self._defaults[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._defaults)

    def __len__(self) -> int:
        return len(self._defaults)

    def __setitem__(self, key: str, value: Any) -> None:
        raise TypeError(f"{self._owner_name}.defaults is read-only: defaults only apply to groups "
                        f"added later, which go to the leaf optimizer before wrapping; set "
                        f"{key!r} on the param groups instead")

    def __repr__(self) -> str:
        return repr(self._defaults)
