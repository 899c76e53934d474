"""What a checkpoint holds and what each consumer will do with it, read offline
(docs/main_params.md#7-the-checkpoint-command, docs/cli.md#checkpoint).

:func:`inspect_checkpoint` reads a DCP folder's metadata or a ``torch.save`` file (no tensor data
beyond a few param group settings) and reports the layout (:mod:`.upstream_layout`), which params
carry fp32 main params, the dtypes, the world size it was saved at, whether it is complete for a
model, and the outcome each consumer will have. The outcomes of our own loaders come from the very
decision they take (:func:`.main_params_checkpoint.main_params_branch`); torch's and upstream's from
the keys their templates ask for (tests/test_checkpoint_command.py runs every loader and compares).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from ._leaf_views import MAIN_PARAM
from ._main_params_state import MAIN_PARAMS_KEY, MP_KEY, names_by_identity
from .checkpoint_files import CheckpointError, DcpFolder, TorchSaveFile, open_checkpoint
from .main_params_checkpoint import main_params_branch
from .tensors import is_torch_dtensor
from .upstream_layout import SECTION, SavedLayout

__all__ = ["inspect_checkpoint", "read_model_fqns", "ModelSpec", "CheckpointError", "flat_keys", "index_names"]

LOW_PRECISION = ("torch.bfloat16", "torch.float16")
_DTYPE_NAMES = {"bf16": "torch.bfloat16", "bfloat16": "torch.bfloat16", "fp16": "torch.float16",
                "float16": "torch.float16", "half": "torch.float16", "fp32": "torch.float32",
                "float32": "torch.float32", "float": "torch.float32"}


@dataclass
class ModelSpec:
    """The params of the model that will load the checkpoint: FQN -> dtype name (``None``: unknown)."""

    params: dict[str, str | None]
    source: str

    @property
    def low_precision(self) -> list[str]:
        return [f for f, dtype in self.params.items() if dtype in LOW_PRECISION]


def read_model_fqns(path: str) -> dict[str, str | None]:
    """``--model-fqns FILE``: one param per line, ``FQN`` or ``FQN DTYPE`` (bf16, fp16, fp32 or torch's
    names), ``#`` starts a comment; the FQNs ``model.named_parameters()`` gives."""
    params: dict[str, str | None] = {}
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            words = line.split("#", 1)[0].split()
            if not words:
                continue
            if len(words) > 2:
                raise CheckpointError(f"{path}:{number}: expected 'FQN' or 'FQN DTYPE', got {line.strip()!r}")
            dtype = None
            if len(words) == 2:
                dtype = _DTYPE_NAMES.get(words[1].lower().removeprefix("torch."))
                if dtype is None:
                    raise CheckpointError(f"{path}:{number}: unknown dtype {words[1]!r} (bf16, fp16 or fp32)")
            params[words[0]] = dtype
    if not params:
        raise CheckpointError(f"{path} lists no FQN")
    return params


# ------------------------------------------------------------------------------------------ reading

def _describe(value: Any) -> dict:
    if isinstance(value, torch.Tensor):
        return {"kind": "tensor", "dtype": str(value.dtype), "shape": list(value.shape)}
    return {"kind": "object"}


def flat_keys(ckpt: DcpFolder | TorchSaveFile) -> dict[str, dict]:
    """Every entry as DCP names it (``model.<fqn>``, ``optimizer.state.<fqn>.<key>``, ...) -> its kind,
    dtype and global shape. A ``torch.save`` dict keyed by position gets its FQNs from the groups'
    ``param_names`` or the RFC section (the very tensors), else ``#<index>``."""
    if isinstance(ckpt, DcpFolder):
        out = {}
        for key, md in ckpt.entries.items():
            props = getattr(md, "properties", None)
            out[key] = ({"kind": "tensor", "dtype": str(props.dtype), "shape": list(md.size)}
                        if props is not None else {"kind": "object"})
        return out
    out = {f"model.{k}": _describe(v) for k, v in ckpt.model.items() if isinstance(v, torch.Tensor)}
    osd = ckpt.optimizer
    if "state" not in osd:   # torch's flattened layout
        out.update({f"optimizer.{k}": _describe(v) for k, v in osd.items() if k != MP_KEY})
    else:
        names = index_names(osd)
        for key, entry in osd.get("state", {}).items():
            for name, value in (entry.items() if isinstance(entry, dict) else ()):
                out[f"optimizer.state.{names.get(key, key)}.{name}"] = _describe(value)
        for i, group in enumerate(osd.get("param_groups", [])):
            out.update({f"optimizer.param_groups.{i}.{k}": {"kind": "object"} for k in group})
    section = osd.get(MP_KEY, {}).get(MAIN_PARAMS_KEY, {}) if isinstance(osd.get(MP_KEY), dict) else {}
    out.update({f"optimizer.{SECTION}.{fqn}": _describe(v) for fqn, v in section.items()})
    return out


def index_names(osd: dict) -> dict:
    """Position key -> FQN, where the state dict tells it."""
    groups = osd.get("param_groups", [])
    names: dict = {}
    section = osd.get(MP_KEY, {}).get(MAIN_PARAMS_KEY) if isinstance(osd.get(MP_KEY), dict) else None
    by_identity = names_by_identity(groups, osd.get("state", {}), section) if section else None
    for gi, group in enumerate(groups):
        keys = group.get("params", [])
        for pi, key in enumerate(keys):
            if isinstance(key, str):
                continue
            if "param_names" in group and len(group["param_names"]) == len(keys):
                names[key] = group["param_names"][pi]
            elif by_identity and by_identity[gi][pi]:
                names[key] = by_identity[gi][pi]
            else:
                names[key] = f"#{key}"
    return names


def _world_size(ckpt: DcpFolder | TorchSaveFile) -> tuple[int | None, str]:
    if isinstance(ckpt, DcpFolder):
        return ckpt.world_size(), "the rank files __<rank>_<n>.distcp"
    for value in _tensors(ckpt.obj):
        if is_torch_dtensor(value):
            return value.device_mesh.size(), "the device mesh of its DTensors"
    return None, "not recorded (one rank's file of plain tensors)"


def _tensors(tree: Any):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from _tensors(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _tensors(value)


def _group_params(ckpt: DcpFolder | TorchSaveFile, layout: SavedLayout, prefix: str) -> list[str]:
    """The params the optimizer holds (stateless ones too), from its groups."""
    fqns = list(layout.flat_groups)
    if isinstance(ckpt, DcpFolder):
        for i in sorted(layout.nested_groups):
            try:
                fqns.extend(str(f) for f in ckpt.read_object(f"{prefix}.param_groups.{i}.params"))
            except (CheckpointError, Exception):   # noqa: BLE001 - a group list we cannot read names nothing
                pass
    else:
        names = index_names(ckpt.optimizer) if "state" in ckpt.optimizer else {}
        for group in ckpt.optimizer.get("param_groups", []):
            fqns.extend(str(names.get(k, k)) for k in group.get("params", []))
    return fqns


# ------------------------------------------------------------------------------------------ consumers

def _optimizer_prefix(entries: dict) -> str:
    """The top-level name the optimizer state is saved under: ``optimizer`` (torch's recipe, hyper's and
    ours), else the first one holding ``state``/``param_groups`` (``optim`` in some examples)."""
    found = [k.split(".", 1)[0] for k in entries if ".state." in k or ".param_groups." in k]
    return "optimizer" if "optimizer" in found or not found else found[0]


def _kind(layout: SavedLayout) -> str:
    if any("master_param" in names for names in layout.state.values()):
        return "fused_adam"
    return layout.name


def _ours(layout: SavedLayout, spec: ModelSpec, missing_model: list[str], fmt: str) -> dict:
    who = ("npu_fsdp_patches.optim.load_checkpoint" if fmt == "dcp"
           else "npu_fsdp_patches.optim.MainParamsOptimizer.load_state_dict")
    if missing_model:
        return {"consumer": who, "outcome": "refused", "missing": missing_model,
                "why": f"the checkpoint lacks model entries: {', '.join(missing_model)}"}
    try:
        branch = main_params_branch(layout, spec.low_precision)
    except ValueError as exc:
        return {"consumer": who, "outcome": "refused", "branch": None, "why": str(exc),
                "missing": _missing_main_params(layout, spec)}
    if branch == "main_params":
        return {"consumer": who, "outcome": "exact", "branch": branch,
                "why": "every fp32 main param is restored as saved"}
    return {"consumer": who, "outcome": "rebuilt", "branch": branch,
            "why": "no fp32 main params: rebuilt from the bf16/fp16 model params with a warning "
                   "(the fp32 tails are lost)"}


def _missing_main_params(layout: SavedLayout, spec: ModelSpec) -> list[str]:
    if layout.section:
        section = set(layout.section)
        return sorted(f for f in spec.low_precision if f not in section)
    return sorted(f for f in spec.low_precision if f in layout.state and MAIN_PARAM not in layout.state[f])


def _torch_api(layout: SavedLayout, spec: ModelSpec, missing_model: list[str], fmt: str) -> dict:
    who = "dcp.load + set_state_dict (torch's default planner) into a MainParamsOptimizer"
    if fmt != "dcp":
        return {"consumer": who, "outcome": "not applicable",
                "why": "one rank's torch.save file: load it with the optimizer's own load_state_dict"}
    missing = [f"model.{f}" for f in missing_model]
    if layout.flat_groups and not layout.nested_groups:
        first = sorted(k for k in next(iter(layout.flat_groups.values())))[:1]
        missing.append(f"optimizer.param_groups.0.{first[0] if first else 'lr'}")
    for fqn in spec.params:
        if fqn not in layout.state:
            missing.append(f"optimizer.state.{fqn}.<every state>")
        elif fqn in spec.low_precision and MAIN_PARAM not in layout.state[fqn]:
            missing.append(f"optimizer.state.{fqn}.{MAIN_PARAM}")
    if missing:
        return {"consumer": who, "outcome": "refused", "missing": missing,
                "why": f"Missing key in checkpoint state_dict: {missing[0]}"
                       + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")}
    return {"consumer": who, "outcome": "exact", "why": "every key torch's template asks for is saved"}


def _upstream(layout: SavedLayout, spec: ModelSpec, missing_model: list[str], fmt: str,
              by_position: bool = False) -> dict:
    who = ("hyper-parallel's Float16OptimizerWithFloat16Params + its DCP checkpointer" if fmt == "dcp"
           else "hyper-parallel's Float16OptimizerWithFloat16Params.load_state_dict")
    out = _upstream_branch(layout, spec, missing_model, fmt, who)
    if by_position:   # its ChainedOptimizer hands a state keyed by position to every leaf (torch's rule)
        out["several_optimizers"] = "refused"
        out["why"] += ("; over one optimizer only: a chain of several (Muon + AdamW) hands this state, keyed "
                       "by position, to each of them, and torch refuses the group count (save "
                       "upstream_state_dict() for it)")
    return out


def _upstream_branch(layout: SavedLayout, spec: ModelSpec, missing_model: list[str], fmt: str, who: str) -> dict:
    groups = ("flattened: what its ChainedOptimizer(flatten=True) over several optimizers (Muon + AdamW) reads"
              if layout.flat_groups else "nested: what a ChainedOptimizer over one optimizer (AdamW) reads")
    if missing_model and fmt == "dcp":   # its planner checks the model first
        return {"consumer": who, "outcome": "refused", "branch": None, "param_groups": groups,
                "why": f"Checkpoint is missing {len(missing_model)} model key(s): {', '.join(missing_model)}"}
    section = set(layout.section)
    present = [f for f in spec.low_precision if f in section]
    missing = [f for f in spec.low_precision if f not in section]
    if not missing:
        return {"consumer": who, "outcome": "exact", "branch": 1, "param_groups": groups,
                "why": "branch 1: every main param is in its _mixed_precision_optimizer section"}
    if not present:
        return {"consumer": who, "outcome": "rebuilt", "branch": 2, "param_groups": groups,
                "why": "branch 2: no _mixed_precision_optimizer section: reload_model_params() and a "
                       "warning (the fp32 tails are lost)"}
    return {"consumer": who, "outcome": "refused", "branch": 3, "param_groups": groups, "missing": missing,
            "why": f"branch 3: missing fp32 main parameters: {', '.join(missing)}"}


# ------------------------------------------------------------------------------------------ report

def inspect_checkpoint(path: str | os.PathLike, model_fqns: dict[str, str | None] | None = None) -> dict:
    """The report ``npu-fsdp-patches checkpoint PATH`` prints (docs/cli.md#checkpoint)."""
    ckpt = open_checkpoint(path)
    fmt = "dcp" if isinstance(ckpt, DcpFolder) else "torch.save"
    entries = flat_keys(ckpt)
    prefix = _optimizer_prefix(entries)
    layout = SavedLayout.from_keys(entries, prefix)
    by_position = (fmt == "torch.save" and "state" in ckpt.optimizer and any(
        not isinstance(k, str) for k in ckpt.optimizer.get("state", {}))) or (
        fmt == "dcp" and bool(layout.state) and all(f.isdigit() and f not in layout.model for f in layout.state))
    world, world_source = _world_size(ckpt)
    model_dtype = {fqn: entries[f"model.{fqn}"]["dtype"] for fqn in layout.model
                   if entries[f"model.{fqn}"]["kind"] == "tensor"}
    known = dict.fromkeys([*_group_params(ckpt, layout, prefix), *layout.state, *layout.section])
    if model_fqns is not None:
        spec = ModelSpec({f: d or model_dtype.get(f) for f, d in model_fqns.items()}, "--model-fqns")
    else:
        spec = ModelSpec({f: model_dtype.get(f) or (LOW_PRECISION[0] if f in layout.main_params() else None)
                          for f in known}, "the checkpoint's optimizer state")
    named = model_fqns is not None or not by_position   # position keys name no model param
    missing_model = (sorted(f for f in spec.params if f not in model_dtype)
                     if named and (layout.model or fmt == "dcp") else [])
    kind = _kind(layout)
    params, section = [], set(layout.section)
    for fqn in dict.fromkeys([*spec.params, *known]):
        main_key = (f"{prefix}.{SECTION}.{fqn}" if fqn in section
                    else f"{prefix}.state.{fqn}.{MAIN_PARAM}")
        params.append({"fqn": fqn, "model_dtype": model_dtype.get(fqn), "shape": entries.get(
            f"model.{fqn}", {}).get("shape"), "optimizer_state": sorted(layout.state.get(fqn, ())),
            "fp32_main_param": main_key in entries,
            "main_param_dtype": entries.get(main_key, {}).get("dtype")})
    if kind == "fused_adam":
        consumers = {"fused_adam": {"consumer": "FusedAdam (its load_state_dict, or torch's API)",
                                    "outcome": "exact", "why": "FusedAdam state: its master weights "
                                    "(master_param) and moments load into a FusedAdam"},
                     **{k: {"consumer": k, "outcome": "not applicable",
                            "why": "a FusedAdam checkpoint: its fp32 masters are FusedAdam's master_param, "
                                   "not a main-params wrapper's"} for k in ("ours", "upstream")}}
    else:
        consumers = {"ours": _ours(layout, spec, missing_model, fmt),
                     "torch": _torch_api(layout, spec, missing_model, fmt),
                     "upstream": _upstream(layout, spec, missing_model, fmt, by_position and fmt == "torch.save")}
    ours = consumers["ours"]["outcome"] if "ours" in consumers else "exact"
    complete = not missing_model and ours in ("exact", "not applicable")
    return {
        "path": os.fspath(path), "format": fmt, "layout": kind, "optimizer_key": prefix,
        "state_keys": "position" if by_position else "fqn",
        "param_groups": "flattened" if layout.flat_groups else ("nested" if layout.nested_groups else "none"),
        "world_size": world, "world_size_from": world_source,
        "model": {"from": spec.source, "params": len(spec.params), "low_precision": spec.low_precision,
                  "missing_in_checkpoint": missing_model},
        "main_params": {"saved": layout.main_params(), "where": (
            f"optimizer.{SECTION}.<fqn>" if layout.section else
            f"optimizer.state.<fqn>.{MAIN_PARAM}" if layout.main_param_fqns else None)},
        "params": params, "complete": complete, "consumers": consumers,
        "dtypes": sorted({e["dtype"] for e in entries.values() if e["kind"] == "tensor"}),
    }
