"""Write-through views of a wrapper optimizer's leaf optimizers: ``state``, ``param_groups``, ``defaults``.

torch code handed an optimizer (LR schedulers, grad clipping, torch's distributed state-dict API)
reads *and writes* these attributes, and matches params by identity with the model's
``named_parameters()``. So the views show the *model* params: ``param_groups[i]["params"]`` lists
model params and ``state`` is keyed by model params, while the leaf optimizers step on the fp32
main params behind them. A low-precision param's state also holds its fp32 main param under
``"main_param"`` (as Transformer Engine's ``FusedAdam`` keeps ``master_param``). Every write goes
to the leaf optimizer that owns the param or group; a write that has no owner is refused with an
error saying what to do instead. A key of ``state`` that is no tensor (``opt.state["note"] = 1``, as
torch's state-dict hook tests write) is kept by the wrapper itself, as a plain optimizer keeps it.

Every view names the containers it writes through to (``rollback_targets()``), so an undo record
(:mod:`._rollback`) taken of a view records them.
"""
from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any, Callable, Iterator

import torch

__all__ = ["MAIN_PARAM", "LeafState", "LeafParamGroups", "ModelParamGroup", "LeafDefaults"]

#: per-param state key of the fp32 main param of a bf16/fp16 param
MAIN_PARAM = "main_param"

ModelOf = Callable[[torch.Tensor], torch.Tensor]
CopyInto = Callable[[torch.Tensor, Any], None]


class ModelParamGroup(MutableMapping):
    """A leaf param group as torch code sees it: ``"params"`` lists the model params; every other
    entry is the leaf group's own, read and written in place (``group["lr"] = ...``)."""

    def __init__(self, group: dict, model_of: ModelOf, owner: str) -> None:
        self._group = group
        self._params = [model_of(p) for p in group["params"]]
        self._owner_name = owner

    def __getitem__(self, key: str) -> Any:
        return self._params if key == "params" else self._group[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if key == "params":
            raise TypeError(f"{self._owner_name}: a param group's params are fixed when the group is "
                            f"made (their main params are made then); add params with add_param_group")
        self._group[key] = value

    def __delitem__(self, key: str) -> None:
        if key == "params":
            self[key] = None   # refused, same message
        del self._group[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._group)

    def __len__(self) -> int:
        return len(self._group)

    def __repr__(self) -> str:
        return repr(dict(self))

    def __reduce_ex__(self, protocol: Any) -> tuple:
        return dict, (dict(self),)   # copies and pickles are plain dicts

    def leaf_group(self) -> dict:
        """The leaf optimizer's own group dict this view shows."""
        return self._group

    def rollback_targets(self) -> list:
        return [self._group, self._group["params"]]


class LeafParamGroups(list):
    """The leaf optimizers' param groups, in leaf order, as :class:`ModelParamGroup` views.

    ``append``/``extend``/``+=`` go to ``add(group)`` (the wrapper's: a group of the view is repeated in
    its leaf, as torch's ``param_groups.extend(param_groups)`` repeats it; a new group is added with its
    main params). Removing, replacing or reordering groups is refused: their params' main params and
    state would be orphaned.
    """

    _REFUSAL = ("{owner}.param_groups is a view of the wrapped optimizers' param groups: edit a "
                "group's entries in place (group['lr'] = ...) and add groups with append/extend or "
                "add_param_group; removing, replacing or reordering groups is not supported (their "
                "params' main params and state would be orphaned): build a new optimizer instead")

    def __init__(self, leaves: list[torch.optim.Optimizer], model_of: ModelOf, owner: str,
                 add: Callable[[Any], None] | None = None) -> None:
        super().__init__(ModelParamGroup(group, model_of, owner)
                         for leaf in leaves for group in leaf.param_groups)
        self._leaves, self._owner_name, self._add = leaves, owner, add

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(self._REFUSAL.format(owner=self._owner_name))

    def append(self, group: Any) -> None:
        if self._add is None:
            self._refuse()
        self._add(group)
        list.append(self, group)

    def extend(self, groups: Any) -> None:
        for group in list(groups):   # a list of the view itself: its groups as they are now
            self.append(group)

    def __iadd__(self, groups: Any) -> "LeafParamGroups":
        self.extend(groups)
        return self

    def __reduce_ex__(self, protocol: Any) -> tuple:
        return list, (list(self),)   # copies and pickles are plain lists

    def rollback_targets(self) -> list:
        groups = [group for leaf in self._leaves for group in leaf.param_groups]
        return [leaf.param_groups for leaf in self._leaves] + groups + [g["params"] for g in groups]

    insert = remove = pop = clear = sort = reverse = _refuse
    __setitem__ = __delitem__ = __imul__ = _refuse


class MainParamEntry(MutableMapping):
    """``state[model_param]`` of a bf16/fp16 param: its leaf state (keyed there by the main param)
    plus ``"main_param"``, the fp32 main param itself. Writing ``"main_param"`` copies the values
    into the main param (its identity stays: the leaf optimizer steps on it)."""

    def __init__(self, leaf_state: dict, main: torch.Tensor, copy_into: CopyInto) -> None:
        self._state, self._main, self._copy_into = leaf_state, main, copy_into

    def __getitem__(self, key: str) -> Any:
        return self._main if key == MAIN_PARAM else self._state[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if key == MAIN_PARAM:
            self._copy_into(self._main, value)
        else:
            self._state[key] = value

    def __delitem__(self, key: str) -> None:
        if key == MAIN_PARAM:
            raise TypeError("the fp32 main param of a bf16/fp16 param cannot be deleted from its state")
        del self._state[key]

    def __iter__(self) -> Iterator[str]:
        yield from list(self._state)
        yield MAIN_PARAM

    def __len__(self) -> int:
        return len(self._state) + 1

    def __repr__(self) -> str:
        return repr(dict(self))

    def rollback_targets(self) -> list:
        return [self._state]


class LeafState(MutableMapping):
    """``{model_param: state}`` across the leaf optimizers; reads and writes go to the owning leaf.

    A param is in the view exactly when its leaf optimizer holds state for its main param, so the
    view is empty exactly when the leaves are (torch's ``_init_optim_state`` primes an optimizer
    whose ``state`` is empty). Like a plain optimizer's ``state`` (a ``defaultdict(dict)``), reading
    a param that has no state yet creates its empty dict, in its leaf. A tensor key that is no model
    param of the wrapped optimizers is refused (``describe(key)`` says why; a plain optimizer would
    fail later, in ``state_dict()``). Any other key (``state["note"]``) lives in ``extras``, the
    wrapper's own dict, as it would in a plain optimizer's ``state``: listed after the params, saved
    by ``state_dict()`` and restored by ``load_state_dict()``.
    """

    def __init__(self, leaves: list[torch.optim.Optimizer], main_of: Callable[[Any], Any],
                 model_of: ModelOf, describe: Callable[[Any], str], copy_into: CopyInto,
                 extras: dict | None = None) -> None:
        self._leaves = leaves
        self._main_of, self._model_of = main_of, model_of
        self._describe, self._copy_into = describe, copy_into
        self._extras = {} if extras is None else extras
        self._owner_by_id: dict[int, torch.optim.Optimizer] = {}

    def _owner(self, param: Any) -> tuple[torch.optim.Optimizer | None, Any]:
        main = self._main_of(param)
        if main is None:
            return None, None
        leaf = self._owner_by_id.get(id(main))
        if leaf is None:
            self._owner_by_id = {id(p): leaf for leaf in self._leaves
                                 for group in leaf.param_groups for p in group["params"]}
            leaf = self._owner_by_id.get(id(main))
        return leaf, main

    def _leaf_for(self, param: Any) -> tuple[torch.optim.Optimizer, Any]:
        leaf, main = self._owner(param)
        if leaf is None:
            raise KeyError(f"cannot use {self._describe(param)} as a key of the optimizer state: "
                           f"it is no model param of the wrapped optimizers' param groups")
        return leaf, main

    def _entry(self, leaf_state: dict, main: Any, param: Any) -> Any:
        return leaf_state if main is param else MainParamEntry(leaf_state, main, self._copy_into)

    def __getitem__(self, param: Any) -> Any:
        if not isinstance(param, torch.Tensor):
            return self._extras.setdefault(param, {})   # defaultdict(dict), as torch's state
        leaf, main = self._leaf_for(param)
        return self._entry(leaf.state[main], main, param)

    def __setitem__(self, param: Any, value: Any) -> None:
        if not isinstance(param, torch.Tensor):
            self._extras[param] = value
            return
        leaf, main = self._leaf_for(param)
        if main is param:
            leaf.state[main] = value
            return
        value = dict(value)
        saved_main = value.pop(MAIN_PARAM, None)
        leaf.state[main] = value
        if saved_main is not None:
            self._copy_into(main, saved_main)

    def __delitem__(self, param: Any) -> None:
        if not isinstance(param, torch.Tensor):
            del self._extras[param]
            return
        leaf, main = self._leaf_for(param)
        del leaf.state[main]

    def __contains__(self, param: object) -> bool:
        if not isinstance(param, torch.Tensor):
            return param in self._extras
        leaf, main = self._owner(param)
        return leaf is not None and main in leaf.state

    def get(self, param: Any, default: Any = None) -> Any:
        return self[param] if param in self else default

    def __iter__(self) -> Iterator[Any]:
        for leaf in self._leaves:
            for main in list(leaf.state):
                yield self._model_of(main)
        yield from list(self._extras)

    def __len__(self) -> int:
        return sum(len(leaf.state) for leaf in self._leaves) + len(self._extras)

    def __repr__(self) -> str:
        extras = f" and {len(self._extras)} other key(s)" if self._extras else ""
        return (f"LeafState({len(self) - len(self._extras)} params over {len(self._leaves)} leaf "
                f"optimizer(s){extras})")

    def rollback_targets(self) -> list:
        entries = [entry for leaf in self._leaves for entry in leaf.state.values() if isinstance(entry, dict)]
        extras = [value for value in self._extras.values() if isinstance(value, dict)]
        return [leaf.state for leaf in self._leaves] + entries + [self._extras] + extras


class LeafDefaults(MutableMapping):
    """The first leaf optimizer's ``defaults``. Over one leaf, writes go to it (they seed the groups
    :meth:`add_param_group` adds later, as on a plain optimizer); over several, writes are refused:
    the wrapper cannot tell which leaf a later group goes to, so no write could take effect."""

    def __init__(self, defaults: dict, owner: str, writable: bool) -> None:
        self._defaults, self._owner_name, self._writable = defaults, owner, writable

    def __getitem__(self, key: str) -> Any:
        return self._defaults[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._defaults)

    def __len__(self) -> int:
        return len(self._defaults)

    def __setitem__(self, key: str, value: Any) -> None:
        if not self._writable:
            raise TypeError(f"{self._owner_name}.defaults is read-only over several leaf optimizers: "
                            f"defaults only seed groups added later, which go to a leaf optimizer before "
                            f"wrapping; set {key!r} on the param groups instead")
        self._defaults[key] = value

    def __delitem__(self, key: str) -> None:
        if not self._writable:
            self[key] = None   # refused, same message
        del self._defaults[key]

    def __repr__(self) -> str:
        return repr(self._defaults)

    def rollback_targets(self) -> list:
        return [self._defaults]
