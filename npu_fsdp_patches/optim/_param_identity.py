"""Find references to swapped-out params that an optimizer keeps outside ``state`` and ``param_groups``.

Wrapping swaps each low-precision param for its fp32 main param in the optimizer's param groups and
``state``. An optimizer that also remembers params elsewhere (a cache built in ``__init__``: a list
of params, a ``{param: ...}`` or ``{id(param): ...}`` map, as older hyper-parallel Muon had) would
keep stepping or looking up the old params. Whether it does is a property of the instance, not of
its class name (veomni's ``DistributedMuon`` and ``torch.optim.Muon`` keep nothing; a caching Muon
does), so the instance's attributes are searched for the old params' identities.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Iterator

import torch
from torch import nn

__all__ = ["stale_param_references"]

#: Attributes torch.optim.Optimizer manages itself (swapped by the wrapper, or holding no params).
_OPTIMIZER_OWNED = frozenset({"state", "param_groups", "defaults"})
_MAX_DEPTH = 4


def stale_param_references(optimizer: Any, names_by_id: dict[int, str]) -> list[str]:
    """``"attr.path -> fqn"`` for every place in ``optimizer``'s attributes (besides ``state``,
    ``param_groups`` and ``defaults``) that holds a param of ``names_by_id`` or its ``id()``."""
    found: list[str] = []
    seen: set[int] = set()
    for attr, value in vars(optimizer).items():
        if attr not in _OPTIMIZER_OWNED:
            for path, fqn in _walk(value, f"{type(optimizer).__name__}.{attr}", names_by_id, seen, 0):
                found.append(f"{path} -> {fqn!r}")
    return found


def _walk(value: Any, path: str, names_by_id: dict[int, str], seen: set[int],
          depth: int) -> Iterator[tuple[str, str]]:
    if isinstance(value, torch.Tensor):
        if id(value) in names_by_id:
            yield path, names_by_id[id(value)]
        return
    if isinstance(value, int) and not isinstance(value, bool):
        if value in names_by_id:          # an id(param) key: CPython ids are addresses, never small
            yield path, names_by_id[value]
        return
    if depth >= _MAX_DEPTH or id(value) in seen or _is_opaque(value):
        return
    seen.add(id(value))
    if isinstance(value, Mapping):
        for i, (key, item) in enumerate(list(value.items())):
            yield from _walk(key, f"{path}<key {i}>", names_by_id, seen, depth + 1)
            yield from _walk(item, f"{path}[{key!r}]" if isinstance(key, (str, int)) else f"{path}[{i}]",
                             names_by_id, seen, depth + 1)
    elif isinstance(value, (list, tuple, set, frozenset)):
        for i, item in enumerate(list(value)):
            yield from _walk(item, f"{path}[{i}]", names_by_id, seen, depth + 1)
    elif hasattr(value, "__dict__"):
        for attr, item in list(vars(value).items()):
            yield from _walk(item, f"{path}.{attr}", names_by_id, seen, depth + 1)


def _is_opaque(value: Any) -> bool:
    """Objects that hold params by design (modules) or hold none (scalars, callables, types)."""
    return (value is None or isinstance(value, (str, bytes, float, complex, bool, type, nn.Module))
            or callable(value) and not isinstance(value, (Mapping, list, tuple, set, frozenset)))
