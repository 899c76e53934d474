"""The optimizer-state layouts a main-params checkpoint comes in, and hyper-parallel's own
(docs/main_params.md#2-checkpoints-where-each-goes-and-what-reads-it).

Two layouts of the same state, by where the fp32 main params sit:

* **torch** (torch's state-dict API, :func:`~.main_params_checkpoint.save_checkpoint`'s default):
  ``state.<fqn>.main_param`` for every bf16/fp16 param (checkpoints from before issue 40: for those
  with optimizer state), param groups nested
  (``param_groups.<i>.<key>``, ``param_groups.<i>.params`` = FQNs);
* **upstream** (hyper-parallel's ``Float16OptimizerWithFloat16Params`` over its ``ChainedOptimizer``,
  saved by its DCP checkpointer in one save with the model): the inner state keyed by FQN, the main
  params only in ``_mixed_precision_optimizer.fp32_from_fp16_params.<fqn>`` (every bf16/fp16 param),
  param groups flattened (``param_groups.<fqn>.<key>``) when the chain holds several optimizers
  (``ChainedOptimizer(flatten=True)``, Muon + AdamW), nested otherwise. Our earlier layout (before the
  move to torch's API) is the nested form of this one.

:func:`upstream_state_dict` builds the upstream layout from a :class:`MainParamsOptimizer`;
:class:`SavedLayout` reads either from a checkpoint's keys (no tensor data), for
:func:`~.main_params_checkpoint.load_checkpoint` and the ``checkpoint`` command.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from ._leaf_views import MAIN_PARAM
from ._main_params_state import MAIN_PARAMS_KEY, MP_KEY
from .main_params import MainParamsOptimizer
from .tensors import is_foreign_dtensor

__all__ = ["upstream_state_dict", "upstream_flattens", "SavedLayout", "SECTION", "to_torch_layout"]

#: the RFC section's key prefix inside the optimizer state (docs/hyper_parallel.md#rfc-001-9-checkpoints)
SECTION = f"{MP_KEY}.{MAIN_PARAMS_KEY}"


def upstream_flattens(optimizer: MainParamsOptimizer) -> bool:
    """Whether hyper-parallel's ``ChainedOptimizer`` over these leaves flattens its state: its own
    ``flatten`` where the wrapped chain has one, else whether it holds several optimizers
    (``get_hyper_optimizer`` flattens exactly for Muon + AdamW, docs/hyper_parallel.md#14-optimizers)."""
    flatten = getattr(optimizer.optimizer, "flatten", None)
    return bool(flatten) if flatten is not None else len(optimizer.leaf_optimizers) > 1


def upstream_state_dict(model: nn.Module, optimizer: MainParamsOptimizer, *,
                        flatten: bool | None = None) -> dict[str, Any]:
    """``optimizer``'s state as hyper-parallel's ``Float16OptimizerWithFloat16Params.state_dict()``
    gives it for the same model and leaves: torch's FQN-keyed layout of the leaf state (flattened,
    ``state.<FQN>.<key>`` and ``param_groups.<FQN>.<key>``, when ``flatten``; by default as upstream's
    chain would, :func:`upstream_flattens`), no per-param ``main_param``, and the RFC section holding
    every bf16/fp16 param's main param (the live tensors, no copy). So each main param is stored
    once, and upstream's wrapper and DCP checkpointer read it with no fallback. Not for hyper-parallel
    DTensors, which torch's state-dict API cannot handle: there ``optimizer.state_dict()`` is
    upstream's layout already."""
    if not isinstance(optimizer, MainParamsOptimizer):
        raise TypeError(f"upstream_state_dict: expected a MainParamsOptimizer, got {type(optimizer).__name__}")
    foreign = [name for name, p in model.named_parameters() if is_foreign_dtensor(p)]
    if foreign:
        raise TypeError(f"upstream_state_dict: {foreign[0]} is a hyper-parallel DTensor; torch's state-dict "
                        f"API cannot read it, and optimizer.state_dict() is upstream's layout there already")
    flat = upstream_flattens(optimizer) if flatten is None else flatten
    osd = get_optimizer_state_dict(model, optimizer,
                                   options=StateDictOptions(flatten_optimizer_state_dict=flat))
    if flat:
        suffix = f".{MAIN_PARAM}"
        osd = {k: v for k, v in osd.items() if not (k.startswith("state.") and k.endswith(suffix))}
    else:
        osd = {**osd, "state": {fqn: {k: v for k, v in entry.items() if k != MAIN_PARAM}
                                for fqn, entry in osd["state"].items()}}
    return {**osd, MP_KEY: {MAIN_PARAMS_KEY: optimizer.main_params_by_fqn()}}


def to_torch_layout(optim_state: dict, groups: list[dict]) -> dict:
    """An FQN-keyed optimizer state in either layout (as DCP loaded it into a template of that
    layout) as torch's nested layout with each saved main param as ``state.<fqn>.main_param``.
    ``groups`` are the current nested groups (``params`` = FQNs): flattened group entries are read
    from each group's first param, and a setting the checkpoint lacks keeps its current value."""
    state = {fqn: dict(entry) for fqn, entry in optim_state.get("state", {}).items()}
    for fqn, main in optim_state.get(MP_KEY, {}).get(MAIN_PARAMS_KEY, {}).items():
        state.setdefault(fqn, {})[MAIN_PARAM] = main
    if "param_groups" in optim_state:
        saved = optim_state["param_groups"]
        nested = [{**now, **old} for now, old in zip(groups, saved)]
    else:
        nested = []
        for now in groups:
            first = now["params"][0] if now["params"] else None
            prefix = f"param_groups.{first}."
            nested.append({**now, **{k[len(prefix):]: v for k, v in optim_state.items()
                                     if first is not None and k.startswith(prefix)
                                     and "." not in k[len(prefix):]}})
    return {"state": state, "param_groups": nested}


@dataclass
class SavedLayout:
    """What a checkpoint's keys (DCP metadata keys, or a ``torch.save`` dict's flattened keys) say about
    its optimizer state, under the prefix ``optimizer``. FQNs are split off known key shapes: state,
    group and ``main_param`` keys hold no dot, so ``state.a.b.exp_avg`` belongs to ``a.b``."""

    model: list[str] = field(default_factory=list)             #: FQNs with a ``model.<fqn>`` entry
    state: dict[str, set] = field(default_factory=dict)        #: FQN -> its saved state keys
    section: list[str] = field(default_factory=list)           #: FQNs in the RFC section
    flat_groups: dict[str, set] = field(default_factory=dict)  #: FQN -> ``param_groups.<fqn>.<key>`` keys
    nested_groups: dict[int, set] = field(default_factory=dict)  #: group index -> its keys
    other: list[str] = field(default_factory=list)             #: keys none of the above

    @classmethod
    def from_keys(cls, keys: Iterable[str], prefix: str = "optimizer") -> SavedLayout:
        out = cls()
        keys = list(keys)
        section = f"{prefix}.{SECTION}."
        nested_index = _nested_group_indices(keys, prefix)
        for key in keys:
            if key.startswith("model."):
                out.model.append(key[len("model."):])
            elif key.startswith(section):
                out.section.append(key[len(section):])
            elif key.startswith(f"{prefix}.state.") and "." in key[len(prefix) + 7:]:
                fqn, name = key[len(prefix) + 7:].rsplit(".", 1)
                out.state.setdefault(fqn, set()).add(name)
            elif key.startswith(f"{prefix}.param_groups.") and "." in key[len(prefix) + 14:]:
                head, name = key[len(prefix) + 14:].rsplit(".", 1)
                if head in nested_index:
                    out.nested_groups.setdefault(int(head), set()).add(name)
                else:
                    out.flat_groups.setdefault(head, set()).add(name)
            else:
                out.other.append(key)
        return out

    @property
    def main_param_fqns(self) -> list[str]:
        """FQNs with a per-param ``main_param`` (torch's layout)."""
        return [fqn for fqn, names in self.state.items() if MAIN_PARAM in names]

    @property
    def name(self) -> str:
        """``"upstream"`` (the RFC section), ``"torch"`` (per-param ``main_param``), ``"both"``, or
        ``"plain"`` (no fp32 main params: a plain optimizer's, or an fp32 model's)."""
        section, per_param = bool(self.section), bool(self.main_param_fqns)
        return {(True, False): "upstream", (False, True): "torch", (True, True): "both"}.get(
            (section, per_param), "plain")

    def main_params(self) -> list[str]:
        """FQNs whose fp32 main param the checkpoint holds, where loading reads it from."""
        return list(self.section) if self.section else self.main_param_fqns


def _nested_group_indices(keys: list[str], prefix: str) -> set[str]:
    """Group indices of torch's nested groups: a nested group always saves its ``params`` list."""
    start, end = f"{prefix}.param_groups.", ".params"
    return {k[len(start):-len(end)] for k in keys
            if k.startswith(start) and k.endswith(end) and k[len(start):-len(end)].isdigit()}
