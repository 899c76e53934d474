"""Patch ``hp_skip_dispatch_adamw``: torch Adam/AdamW under hyper-parallel's SkipDTensorDispatch
computes exactly what torch FSDP2 computes (docs/hyper_parallel.md#18-issue-700;
docs/design.md#44-hp_skip_dispatch_adamw).

Targets: torch's functional ``torch.optim.adam:adam``, which ``Adam.step`` and (torch >= 2.7)
``AdamW.step`` look up as a module global on every step, and ``torch.optim.adamw:adamw``, which
``AdamW.step`` calls instead on torch 2.6, where ``AdamW`` is not an ``Adam`` subclass and runs its
own ``_multi_tensor_adamw``/``_single_tensor_adamw`` (on torch >= 2.7 it is a thin functional API
over ``adam``). Wrapping it (instead of ``Adam.step``, which torch itself rewraps
per class for profiling) covers every caller at once: a plain ``with SkipDTensorDispatch():
optimizer.step()``, hyper's trainer, and the veomni fork's ``wrap_optimizer``, which captured the
bound ``step`` before the patch was applied (docs/hyper_parallel.md#2-veomni).

Only when hyper's dispatch is off (``get_dtensor_dispatch() is False`` in
``hyper_parallel.core.shard._op_dispatch``: the module global of the old generation and the ContextVar
of the new one, docs/hyper_parallel.md#11-generations) and a param is a hyper DTensor, the call is routed to
``npu_fsdp_patches.optim.foreach_adamw.adam_on_local_shards``: torch's own ``adam`` on the
``to_local()`` shards with foreach/fused resolved as torch resolves them for its own DTensor. Any
other call, capturable/differentiable ones included, goes to the original untouched.

Under ``torch.compile`` (dynamo tracing, ``torch.compiler.is_compiling()``) every call goes to the
original, and the ContextVar is never read: dynamo cannot trace ``ContextVar.get``, and the graph break it
caused made a compiled ``AdamW(foreach=True).step`` raise and changed other paths' bits. A compiled
step is then exactly the unpatched compiled step. Hyper's own DTensor does not compile (its
``__torch_function__`` reads the same ContextVar per op): dynamo runs such a step in eager frame by frame,
and where the wrapper runs in eager it routes as above (docs/torch_adam.md#9-compiled-steps).
"""
from __future__ import annotations

import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any

from npu_fsdp_patches.patch import Patch

#: the dispatch switch lives here in both generations (docs/hyper_parallel.md#11-generations, "Dispatch switch" row)
DISPATCH_MODULE = "hyper_parallel.core.shard._op_dispatch"
#: where each generation defines its DTensor (docs/hyper_parallel.md#11-generations, "DTensor module" row) and
#: the platform base (docs/hyper_parallel.md#12-dtensor-and-op-dispatch)
DTENSOR_SOURCES = ("core/dtensor/dtensor.py", "core/dtensor.py", "platform/torch/dtensor.py")
REGISTRY_NAME = "_foreach_supported_types"


def skip_dispatch_active() -> bool:
    """True inside hyper's SkipDTensorDispatch (either generation); never imports hyper."""
    getter = getattr(sys.modules.get(DISPATCH_MODULE), "get_dtensor_dispatch", None)
    return getter is not None and getter() is False


def _foreach_types() -> list:
    module = sys.modules.get("torch.optim.optimizer")  # the list _default_to_fused_or_foreach reads
    return getattr(module, REGISTRY_NAME, [])


def compiling() -> bool:
    """True while dynamo traces the calling step (or ``torch.export`` runs it); dynamo folds it to a constant.

    Looked up at call time: the patch may be applied while ``import torch`` still runs (the plugin imported
    first), before ``torch.compiler`` exists. Only torch's optimizers call the wrapper, so torch is loaded.
    """
    import torch.compiler  # pylint: disable=C0415 - the plugin's import path stays torch-free
    return torch.compiler.is_compiling()


def routed_adam(original):
    """Wrap torch's functional ``adam`` (or torch 2.6's ``adamw``) so hyper-DTensor steps under SkipDTensorDispatch go local."""
    signature = inspect.signature(original)

    def adam(*args, **kwargs):
        if compiling() or not skip_dispatch_active():
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        call = dict(bound.arguments)
        params = call["params"]
        hyper_types = {type(p) for p in params if _is_hyper_dtensor(p)}
        if (not hyper_types or call["capturable"] or call["differentiable"]
                or hyper_types <= set(_foreach_types())):
            return original(*args, **kwargs)
        from npu_fsdp_patches.optim.foreach_adamw import adam_on_local_shards  # pylint: disable=C0415
        lists = [call.pop(name) for name in ("params", "grads", "exp_avgs", "exp_avg_sqs",
                                              "max_exp_avg_sqs", "state_steps")]
        return adam_on_local_shards(original, *lists, **call)

    return adam


def _is_hyper_dtensor(t: Any) -> bool:
    from npu_fsdp_patches.optim.tensors import is_foreign_dtensor  # pylint: disable=C0415
    return is_foreign_dtensor(t) and type(t).__module__.startswith("hyper_parallel.")


class HpSkipDispatchAdamW(Patch):
    """`npu_fsdp_patches.optim.foreach_adamw_step(optimizer)` runs one Adam/AdamW step with torch's own
    functional `adam(foreach=True)` on the local shards, following the installed torch op for op. The
    patch wraps `torch.optim.adam:adam` (and on torch 2.6 `torch.optim.adamw:adamw`, where AdamW is not
    an Adam subclass): inside `SkipDTensorDispatch` (both hyper generations), an Adam/AdamW step over
    hyper DTensors runs what torch would run for its own DTensor. Outside the context nothing changes.
    It covers a plain `optimizer.step()`, hyper's trainer and the veomni fork's `wrap_optimizer`."""

    name = "hp_skip_dispatch_adamw"
    self_test = {"name": "hyper_skip_dispatch", "order": 60,
                 "run": "npu_fsdp_patches.selftest.checks.hyper_skip_dispatch:run"}
    #: torch >= 2.7 steps both Adam and AdamW through ``adam``; torch 2.6's AdamW through ``adamw``
    factories = {"adam": routed_adam, "adamw": routed_adam}

    def upstream_registers_foreach_type(self) -> bool:
        """Stand down when hyper-parallel registers its DTensor in torch's foreach-supported types
        (``torch.optim.optimizer._foreach_supported_types``, where torch registers its own DTensor).

        That is the root cause of the drift: once registered, torch picks the same implementation
        for hyper params as for its own DTensor, and under SkipDTensorDispatch every foreach op runs on
        the local shards, so the stock step already equals torch FSDP2. Read from the loaded classes
        when hyper is imported, else from its sources (the hook fires while torch is still importing,
        so hyper must not be imported here). ``routed_adam`` re-checks the loaded type on every call.
        """
        if any(getattr(t, "__module__", "").startswith("hyper_parallel.") for t in _foreach_types()):
            return True
        spec = importlib.util.find_spec("hyper_parallel")
        if spec is None or not spec.submodule_search_locations:
            return False
        for folder in spec.submodule_search_locations:
            for relative in DTENSOR_SOURCES:
                source = Path(folder, relative)
                if source.is_file() and REGISTRY_NAME in source.read_text(encoding="utf-8", errors="replace"):
                    return True
        return False
