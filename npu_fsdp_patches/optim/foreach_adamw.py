"""torch's own multi-tensor (foreach) Adam/AdamW step, run on the local shards of DTensor params.

Why: under hyper-parallel's ``SkipDTensorDispatch`` a stock ``optimizer.step()`` on bf16 params can drift by
one bf16 ulp from torch FSDP2 (docs/hyper_parallel.md#18-issue-700). torch
FSDP2 on an accelerator runs ``_multi_tensor_adam``, because torch registers its own DTensor in
``_foreach_supported_types``; hyper's DTensor is not registered, so ``foreach=None`` silently takes
``_single_tensor_adam`` (docs/torch_adam.md#2-dispatch; docs/hyper_parallel.md#12-dtensor-and-op-dispatch).
Bit-exactness needs the *same kernel path*, not more precise math: ``_foreach_addcdiv_`` with a scalar list on
the bf16 shards, never fp32 math followed by ``.to(bf16)``.

So this module never re-implements the update. It calls torch's functional ``torch.optim.adam.adam``
(for ``AdamW`` on torch < 2.7, where ``AdamW`` is not an ``Adam`` subclass, its own functional
``torch.optim.adamw.adamw``, as ``AdamW.step`` does there) on plain local tensors (``to_local()`` for
either DTensor flavour) with the implementation chosen explicitly, which follows the installed torch
version op for op. The optimizer state keeps torch's own format (``step`` tensor, ``exp_avg``,
``exp_avg_sq``, ``max_exp_avg_sq``), so ``state_dict()`` and later plain ``step()`` calls are unaffected.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import torch
from torch import Tensor
from torch.optim import adam as torch_adam
from torch.optim import adamw as torch_adamw
from torch.optim.optimizer import (
    _default_to_fused_or_foreach,
    _device_dtype_check_for_fused,
    _get_scalar_dtype,
    _get_value,
)

from ..patch import unpatched
from .tensors import contiguous_operands, copy_back, is_foreign_dtensor, local_tensors

__all__ = ["foreach_adamw_step", "adam_on_local_shards", "torch_dtensor_implementation"]

#: options whose op sequence differs from the foreach path torch FSDP2 runs by default
_NOT_REPRODUCIBLE = {
    "capturable": "the capturable branch of _multi_tensor_adam is a different op sequence",
    "differentiable": "torch's foreach kernels do not support autograd",
}

#: torch >= 2.7 folds AdamW into ``adam(decoupled_weight_decay=...)``; torch 2.6 has no such argument. Read
#: from torch's own function, never from a replacement installed there (a patch of ``adam`` may be applied
#: before this import; a foreign wrapper without ``__wrapped__`` would hide the parameter)
_ADAM_HAS_DECOUPLED_WEIGHT_DECAY = "decoupled_weight_decay" in inspect.signature(unpatched(torch_adam.adam)).parameters


def foreach_adamw_step(optimizer: torch.optim.Optimizer,
                       closure: Optional[Callable[[], Any]] = None) -> Any:
    """One step of a ``torch.optim.Adam``/``AdamW`` computed with torch's foreach kernels on local shards.

    Equals ``torch.optim.AdamW(foreach=True).step()`` on torch DTensors (torch FSDP2) bit for bit, for
    plain, torch-DTensor and hyper-parallel-DTensor params alike. Every group setting is honoured (lr
    float or tensor, betas, eps, weight_decay, amsgrad, maximize, decoupled weight decay); a tensor lr or
    beta is read as its Python value, exactly what torch's foreach path does with a float. A group built
    with ``fused=True`` keeps torch's fused kernel on the local shards. ``capturable`` and
    ``differentiable`` groups raise ``ValueError`` naming the option. Returns the closure's loss.
    """
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise TypeError(f"foreach_adamw_step needs a torch.optim.Adam or AdamW, got {type(optimizer).__name__}")
    functional, weight_decay_kwargs = _functional_adam(optimizer)
    compiling = torch.compiler.is_compiling()
    for index, group in enumerate(optimizer.param_groups):
        for option, why in _NOT_REPRODUCIBLE.items():
            if option == "capturable" and compiling:
                continue   # dynamo's view of every group says capturable=True (see _compiled_capturable)
            if group.get(option, False):
                raise ValueError(f"foreach_adamw_step: param_groups[{index}] sets {option}=True, which it "
                                 f"cannot reproduce exactly ({why}); build the optimizer with {option}=False")
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    with torch.no_grad():
        for index, group in enumerate(optimizer.param_groups):
            lists, has_complex = _init_group(optimizer, group, index)
            beta1, beta2 = group["betas"]
            fused = bool(group.get("fused"))
            _adam_on_locals(
                functional, *lists,
                foreach=not fused, fused=fused, capturable=compiling and _compiled_capturable(group),
                differentiable=False,
                grad_scale=getattr(optimizer, "grad_scale", None) if fused else None,
                found_inf=getattr(optimizer, "found_inf", None) if fused else None,
                has_complex=has_complex, **weight_decay_kwargs(group),
                amsgrad=group["amsgrad"], beta1=beta1, beta2=beta2, lr=group["lr"],
                weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"])
    return loss


def _compiled_capturable(group: dict) -> bool:
    """What torch's own compiled ``Adam.step`` passes as ``capturable``: dynamo shows every param group of a
    traced optimizer with ``capturable=True`` (``OptimizerVariable._set_capturable``,
    torch/_dynamo/variables/optimizer.py), so compiled torch runs the capturable branch of
    ``_multi_tensor_adam`` (step tensors as foreach operands; the non-capturable branch's stacked step
    sizes fail fake-tensor propagation: "Expected scalars to be on CPU, got meta"). Reading the group here
    gives the same view, so a compiled ``foreach_adamw_step`` runs torch's compiled op sequence."""
    return bool(group.get("capturable", False))


def _functional_adam(optimizer: torch.optim.Optimizer) -> tuple[Callable[..., None], Callable[[dict], dict]]:
    """The functional ``optimizer.step`` calls on this torch, and the weight-decay kwargs per group.

    torch >= 2.7: ``AdamW`` subclasses ``Adam`` and both call ``torch.optim.adam.adam`` with
    ``decoupled_weight_decay``. torch 2.6: ``AdamW`` calls its own ``torch.optim.adamw.adamw``
    (``_multi_tensor_adamw``), and ``adam`` has no ``decoupled_weight_decay`` argument.
    """
    if isinstance(optimizer, torch.optim.Adam):
        if not _ADAM_HAS_DECOUPLED_WEIGHT_DECAY:
            return torch_adam.adam, lambda group: {}
        default = isinstance(optimizer, torch.optim.AdamW)
        return torch_adam.adam, lambda group: {
            "decoupled_weight_decay": group.get("decoupled_weight_decay", default)}
    return torch_adamw.adamw, lambda group: {}


def adam_on_local_shards(adam_fn: Callable[..., None], params: list, grads: list, exp_avgs: list,
                         exp_avg_sqs: list, max_exp_avg_sqs: list, state_steps: list, *,
                         foreach: Optional[bool] = None, fused: Optional[bool] = None,
                         **kwargs: Any) -> None:
    """Call torch's functional ``adam`` (``adam_fn``) on the local shards of the given lists.

    ``foreach``/``fused`` left as ``None`` are resolved the way torch resolves them for its *own*
    DTensor params on the shards' device (:func:`torch_dtensor_implementation`), so a DTensor type
    missing from torch's foreach-supported types no longer changes the kernel path. On the foreach path
    a tensor lr/beta is passed as its Python value (torch's foreach path rejects tensors there).
    The fused kernel gets contiguous operands (copied back after), whatever the shards' layout.
    """
    _adam_on_locals(adam_fn, *[local_tensors(ts) for ts in (params, grads, exp_avgs, exp_avg_sqs,
                                                            max_exp_avg_sqs)],
                    list(state_steps), foreach=foreach, fused=fused, **kwargs)


def _adam_on_locals(adam_fn: Callable[..., None], params: list, grads: list, exp_avgs: list,
                    exp_avg_sqs: list, max_exp_avg_sqs: list, state_steps: list, *,
                    foreach: Optional[bool], fused: Optional[bool], **kwargs: Any) -> None:
    """:func:`adam_on_local_shards` on lists that already hold local tensors (``state_steps`` a fresh list)."""
    implementation = torch_dtensor_implementation(
        params, foreach=foreach, fused=fused, lr=kwargs.get("lr"),
        capturable=kwargs.get("capturable", False), differentiable=kwargs.get("differentiable", False))
    if implementation == "foreach" and not kwargs.get("capturable", False):
        for name in ("lr", "beta1", "beta2"):
            if isinstance(kwargs.get(name), Tensor):
                kwargs[name] = _get_value(kwargs[name])
    lists = [params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs]
    write_back = []
    if implementation == "fused":   # torch's fused kernels pair elements by memory position
        lists, write_back = contiguous_operands(lists, read_only=(1,))
    adam_fn(*lists, state_steps, foreach=implementation == "foreach",
            fused=implementation == "fused", **kwargs)
    copy_back(write_back)


def torch_dtensor_implementation(local_params: list, *, foreach: Optional[bool], fused: Optional[bool],
                                 lr: Any = None, capturable: bool = False,
                                 differentiable: bool = False) -> str:
    """``"fused"``, ``"foreach"`` or ``"single"``: what torch's ``adam()`` runs for these flags on
    params of torch's own types on the devices of ``local_params`` (torch/optim/adam.py ``adam``)."""
    if fused:
        return "fused"
    if foreach is None:
        _, foreach = _default_to_fused_or_foreach(local_params, differentiable, use_fused=False)
        if foreach and isinstance(lr, Tensor) and not capturable:
            foreach = False
    return "foreach" if foreach else "single"


def _init_group(optimizer: torch.optim.Optimizer, group: dict, index: int) -> tuple[tuple, bool]:
    """Collect the *local shards* of the group's params with grads and of their state, creating state
    the way torch's ``Adam._init_group`` does (torch/optim/adam.py): state tensors are ``zeros_like``
    the param (a torch DTensor for torch DTensor params; the local shard for hyper params, as torch
    creates it under ``SkipDTensorDispatch``), ``step`` a CPU scalar unless fused (or compiled: then on the
    param's device, as torch's compiled step keeps it). This runs per param
    on every step, so tensors are unwrapped list by list (:func:`local_tensors`)."""
    params, grads = [], []
    for p in group["params"]:
        grad = p.grad   # read once: on a DTensor param this attribute costs about 1 us
        if grad is not None:
            params.append(p)
            grads.append(grad)
    local_params, local_grads = local_tensors(params), local_tensors(grads)
    exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], []
    has_complex = False
    fused, amsgrad, state_of = bool(group.get("fused")), group["amsgrad"], optimizer.state
    # compiled, torch's Adam._init_group sees capturable=True and keeps steps on the params' device
    on_device_steps = torch.compiler.is_compiling() and _compiled_capturable(group)
    for p, local_p, local_g in zip(params, local_params, local_grads):
        if local_g.is_sparse:
            raise RuntimeError("Adam does not support sparse gradients, please consider SparseAdam instead")
        if local_g.shape != local_p.shape:
            position = next(i for i, q in enumerate(group["params"]) if q is p)
            raise RuntimeError(f"param_groups[{index}]['params'][{position}]: grad local shape "
                               f"{tuple(local_g.shape)} differs from the param's {tuple(local_p.shape)}")
        has_complex |= torch.is_complex(local_p)
        state = state_of[p]
        if len(state) == 0:
            template = local_p if is_foreign_dtensor(p) else p
            if fused:
                _device_dtype_check_for_fused(local_p)
            state["step"] = (torch.zeros((), dtype=_get_scalar_dtype(is_fused=fused), device=local_p.device)
                             if fused or on_device_steps else torch.tensor(0.0, dtype=_get_scalar_dtype()))
            state["exp_avg"] = torch.zeros_like(template, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(template, memory_format=torch.preserve_format)
            if amsgrad:
                state["max_exp_avg_sq"] = torch.zeros_like(template, memory_format=torch.preserve_format)
        elif on_device_steps and state["step"].device != local_p.device:
            state["step"] = state["step"].to(local_p.device)   # torch's OptimizerVariable.move_step_if_cpu
        exp_avgs.append(state["exp_avg"])
        exp_avg_sqs.append(state["exp_avg_sq"])
        if amsgrad:
            max_exp_avg_sqs.append(state["max_exp_avg_sq"])
        steps.append(state["step"])
    return (local_params, local_grads, local_tensors(exp_avgs), local_tensors(exp_avg_sqs),
            local_tensors(max_exp_avg_sqs), steps), has_complex
