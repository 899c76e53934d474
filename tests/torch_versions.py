"""What the installed torch offers, for tests that run on every verified torch (2.6.0 ... 2.15.0:
compat_matrix.yaml defaults.verified).

A test that needs a feature some torch lacks is skipped with a reason naming the torch version; the
product behaviour on that torch (a clear error) is tested separately, never skipped.
"""
import functools

import pytest
import torch

#: torch.optim.Muon exists from torch 2.9 (docs/torch_adam.md#7-muon)
HAS_MUON = hasattr(torch.optim, "Muon")
#: torch >= 2.7: AdamW subclasses Adam and both step through torch.optim.adam.adam;
#: torch 2.6: AdamW steps through its own torch.optim.adamw.adamw (_multi_tensor_adamw, ...)
ADAMW_IS_ADAM = issubclass(torch.optim.AdamW, torch.optim.Adam)

#: newer torch rebuilds each flattened optimizer state from the keys present (its
#: _unflatten_optim_state_dict has a nested _reconstruct_nested_dict; a key the state lacks is left out);
#: older torch (measured: 2.6.0 to 2.9.1) indexes state_dict["state.<fqn>.<name>"] for every key of
#: optim.state[param] and raises KeyError (torch/distributed/checkpoint/state_dict.py). Probed, not versioned.
def _flat_load_fills_missing_keys() -> bool:
    import inspect
    from torch.distributed.checkpoint import state_dict
    unflatten = getattr(state_dict, "_unflatten_optim_state_dict", None)
    return unflatten is not None and "_reconstruct_nested_dict" in inspect.getsource(unflatten)


FLAT_LOAD_FILLS_MISSING_KEYS = _flat_load_fills_missing_keys()


#: torch 2.7's ``_StridedShard`` (FSDP2's placement of a dim TP shards too) asserts even sharding when it
#: splits a tensor ("_StridedShard currently only allows even sharding", placement_types.py), so
#: ``distribute_tensor`` cannot build an uneven one there; 2.6.0, 2.9.1 and 2.13.0 split unevenly as ``Shard``
#: does (measured). Probed from the source, not versioned.
def _strided_shard_splits_unevenly() -> bool:
    import inspect
    from torch.distributed.tensor import placement_types
    strided = getattr(placement_types, "_StridedShard", None)
    return strided is None or "only allows even sharding" not in inspect.getsource(strided)


STRIDED_SHARD_SPLITS_UNEVENLY = _strided_shard_splits_unevenly()


@functools.lru_cache(maxsize=None)
def loads_params_without_state() -> bool:
    """Whether torch's ``set_optimizer_state_dict`` loads a state dict that has no state for some param
    (no grad so far), for a plain AdamW (``strict=False``). Measured: torch 2.13.0 does; 2.6.0 raises
    ``KeyError: '<fqn>'`` in ``_split_optim_state_dict``, for any optimizer. Probed (on first use: it
    steps an optimizer), not versioned."""
    from torch import nn
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    model = nn.Module()
    model.stepped, model.idle = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW(list(model.parameters()))
    model.stepped.grad = torch.ones(1)
    opt.step()
    options = StateDictOptions(strict=False)
    try:
        set_optimizer_state_dict(model, opt, get_optimizer_state_dict(model, opt, options=options),
                                 options=options)
    except KeyError:
        return False
    return True

needs_muon = pytest.mark.skipif(
    not HAS_MUON, reason=f"torch.optim.Muon needs torch >= 2.9; this is torch {torch.__version__}")
needs_adam_decoupled_weight_decay = pytest.mark.skipif(
    not ADAMW_IS_ADAM,
    reason=f"Adam(decoupled_weight_decay=...) needs torch >= 2.7; this is torch {torch.__version__}")


def adam_module_for(cls: type):
    """The module whose functional (adam/adamw) and _single/_multi_tensor/_fused kernels ``cls.step`` calls."""
    import torch.optim.adam as adam_module
    import torch.optim.adamw as adamw_module
    return adam_module if issubclass(cls, torch.optim.Adam) else adamw_module

#: FSDP2 forward/backward on CPU needs torch >= 2.7, whose torch.cpu.Stream has record_event
#: (docs/torch_adam.md#8-fsdp2-on-cpu); the optim paths on torch DTensors run in test_layouts.py on every torch
FSDP2_ON_CPU = hasattr(torch.cpu.Stream, "record_event")
needs_fsdp2_on_cpu = pytest.mark.skipif(
    not FSDP2_ON_CPU,
    reason=f"FSDP2 forward/backward on CPU needs torch >= 2.7 (torch.cpu.Stream.record_event); this is "
           f"torch {torch.__version__}")
