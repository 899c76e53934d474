"""A DCP load planner that loads a plain optimizer's checkpoint into a :class:`MainParamsOptimizer`
by leaving its fp32 main params out of the load (docs/main_params.md#3-cross-loading).

A run started with a plain optimizer has no ``main_param`` entries in its checkpoint, while a fresh
``MainParamsOptimizer`` asks for one per bf16/fp16 param (``optimizer.state.<fqn>.main_param``), so
``dcp.load`` with torch's default planner stops at ``Missing key in checkpoint state_dict``. A
checkpointer that calls ``dcp.load`` itself (torchtitan's ``CheckpointManager``) gives its caller no
place to drop those keys from the state dict; a planner is the seam it can take. This one:

* checkpoint without any main param (a plain optimizer's): removes the ``main_param`` entries from
  the load, from the state dict that ``load_state_dict`` then receives too, and warns. The
  wrapper's ``load_state_dict`` then rebuilds them from the loaded model params (with its own
  warning: the fp32 tails lost at the last cast cannot be recovered);
* checkpoint with the main params of some params only: refuses, naming the others, while planning,
  before anything is read or written (DCP reports it as a ``CheckpointException``); so does a
  checkpoint whose main params sit in hyper-parallel's section (``_mixed_precision_optimizer.
  fp32_from_fp16_params.<fqn>``: upstream's layout, or this package's earlier one), which
  ``load_checkpoint`` reads;
* every other key missing from the checkpoint: refused as by torch's default planner.

It reads no framework: the keys are the ones torch's ``get_optimizer_state_dict`` (nested) and
torchtitan's flat FQN layout (``state.<fqn>.main_param``) give.
"""
from __future__ import annotations

import warnings
from typing import Any

from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata

from ._leaf_views import MAIN_PARAM
from ._main_params_state import MAIN_PARAMS_KEY, MP_KEY, raise_partial_main_params

__all__ = ["RebuildMainParamsPlanner"]


def main_param_fqn(path: tuple) -> str | None:
    """The param FQN when ``path`` (a key's path in a state dict) is an fp32 main param entry:
    ``(..., "state", fqn, "main_param")`` nested or ``(..., "state.<fqn>.main_param")`` flat."""
    last = str(path[-1])
    if len(path) >= 3 and last == MAIN_PARAM and path[-3] == "state":
        return str(path[-2])
    head, _, tail = last.partition(".")
    if head == "state" and tail.endswith(f".{MAIN_PARAM}"):
        return tail[:-len(MAIN_PARAM) - 1]
    return None


def _flat_main_param_fqn(key: str) -> str | None:
    """The FQN of a main param entry given as a checkpoint's flat key (``<...>.state.<fqn>.main_param``)."""
    _, sep, rest = f".{key}".partition(".state.")
    if not sep or not rest.endswith(f".{MAIN_PARAM}"):
        return None
    return rest[:-len(MAIN_PARAM) - 1]


class RebuildMainParamsPlanner(DefaultLoadPlanner):
    """torch's ``DefaultLoadPlanner`` that lets a plain optimizer's checkpoint load into a
    ``MainParamsOptimizer``: its main params are rebuilt from the model (see the module doc).

    ``dcp.load(state, checkpoint_id=path, planner=RebuildMainParamsPlanner())``. After the load,
    :attr:`rebuilt` lists the FQNs whose main params were left out (empty when the checkpoint has
    them all). Arguments are the default planner's.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rebuilt: list[str] = []

    def set_up_planner(self, state_dict: dict, metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        self.rebuilt = []
        if metadata is None:
            return
        wanted = {key: fqn for key in self.state_dict
                  if (fqn := main_param_fqn(self.mappings.get(key, (key,)) if self.flatten_state_dict
                                            else (key,))) is not None}
        saved = metadata.state_dict_metadata
        missing = {key: fqn for key, fqn in wanted.items() if key not in saved}
        if not missing:
            return
        if any(_flat_main_param_fqn(key) is not None for key in saved):
            raise_partial_main_params(missing.values())   # some saved, these not: refuse them all
        section = f"{MP_KEY}.{MAIN_PARAMS_KEY}."
        if any(section in key for key in saved):   # saved, but where this load does not look
            raise ValueError(
                f"{type(self).__name__}: the checkpoint holds fp32 main params in hyper-parallel's section "
                f"({MP_KEY}.{MAIN_PARAMS_KEY}.<fqn>: upstream's layout or this package's earlier one), not "
                f"as state.<fqn>.{MAIN_PARAM}; refusing to rebuild them from the model (nothing was "
                f"written). Load it with npu_fsdp_patches.optim.load_checkpoint, which reads that layout.")
        self._leave_out(list(missing))
        self.rebuilt = sorted(missing.values())
        warnings.warn(
            f"{type(self).__name__}: the checkpoint holds no fp32 main params (a plain optimizer's "
            f"checkpoint): {len(self.rebuilt)} main_param entries were left out of the load "
            f"({', '.join(self.rebuilt)}); MainParamsOptimizer.load_state_dict rebuilds them from the "
            f"loaded bf16/fp16 model params, so the fp32 tails lost at the last cast cannot be "
            f"recovered", UserWarning, stacklevel=2)

    def _leave_out(self, keys: list[str]) -> None:
        """Remove ``keys`` from the planned load and from the state dict handed to DCP (which it
        then gives to ``load_state_dict``). Each parent dict is replaced by a filtered copy, so a
        per-param state dict that the optimizer may share is never mutated."""
        by_parent: dict[tuple, set] = {}
        for key in keys:
            del self.state_dict[key]
            path = self.mappings.pop(key, (key,)) if self.flatten_state_dict else (key,)
            by_parent.setdefault(tuple(path[:-1]), set()).add(str(path[-1]))
        for parent_path, names in by_parent.items():
            if not parent_path:
                for name in names:
                    del self.original_state_dict[_key_in(self.original_state_dict, name)]
                continue
            holder = self.original_state_dict
            for step in parent_path[:-1]:
                holder = holder[_key_in(holder, step)]
            key = _key_in(holder, parent_path[-1])
            holder[key] = {k: v for k, v in holder[key].items() if str(k) not in names}


def _key_in(container: Any, step: Any) -> Any:
    """The key or index of ``container`` that a flattening path step names (DCP writes keys as
    ``str(key)``: an index-keyed optimizer state has int keys)."""
    if isinstance(container, (list, tuple)):
        return int(step)
    if step in container:
        return step
    return next(k for k in container if str(k) == step)
