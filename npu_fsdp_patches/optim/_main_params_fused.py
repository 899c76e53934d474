"""The compiled main-params step as one graph: grad cast, the leaf's Adam/AdamW update and copy back.

Under ``torch.compile`` the leaf's own ``step`` graph-breaks on entry and exit (``_use_grad``), so
a compiled :meth:`MainParamsOptimizer.step` over it is three graphs and inductor cannot fuse the
bf16 -> fp32 grad cast, the update and the fp32 -> bf16 copy back (docs/performance.md#compiled-steps).
:func:`compiled_adam_step` runs what the leaf's step runs, torch's functional ``adam`` with the group's
settings as dynamo shows them to torch's own compiled step (``capturable=True``), on the local shards,
with the cast grads handed to it directly: one traced region, which inductor fuses into kernels that
read the bf16 grad and write the bf16 model param (no fp32 grad is written to memory). Model params written
since the last step (docs/main_params.md#contract-with-torch-code) are adopted first, by value, in the same
region: the kernels also read the bf16 model param. (Handing the update ``where(written, model, main)``
instead of adopting in place cost the same and changed inductor's bits against torch's compiled AdamW.)

It runs only while dynamo traces, on torch >= 2.7, and only for a leaf that is exactly ``torch.optim.Adam``/``AdamW``
with torch's own ``step``, no step hooks (the leaf's or global ones: its step would fire them), no
``fused``/``differentiable`` group and its state already created (the first step, which creates it,
takes the ordinary path); anything else returns ``False`` before the first write and the wrapper
takes its ordinary path. Every decision reads only Python state dynamo guards on.
"""
from __future__ import annotations

import inspect

import torch
from torch.optim import adam as torch_adam
from torch.optim import optimizer as torch_optimizer
from torch.optim.optimizer import _default_to_fused_or_foreach

from ._main_param_tensors import released_grads
from .tensors import local_tensor, local_tensors

__all__ = ["compiled_adam_step", "fusable_leaf"]

#: torch's own Adam.step (AdamW inherits it), behind its hook and grad-mode decorators
_TORCH_ADAM_STEP = inspect.unwrap(torch.optim.Adam.step)
#: torch >= 2.7: AdamW is an Adam and torch's functional ``adam`` takes ``decoupled_weight_decay``. On an
#: older torch (2.6) dynamo graph-breaks inside that ``adam`` where torch's own compiled step does not, so
#: the one-graph path is not taken there (the ordinary path keeps torch's break sites and bits)
_ONE_GRAPH_TORCH = "decoupled_weight_decay" in inspect.signature(torch_adam.adam).parameters


def fusable_leaf(leaf: object) -> bool:
    """A leaf whose step is torch's own Adam/AdamW step (checked once, at wrap time)."""
    return (_ONE_GRAPH_TORCH and type(leaf) in (torch.optim.Adam, torch.optim.AdamW) and "step" not in vars(leaf)
            and "_init_group" not in vars(leaf)
            and inspect.unwrap(type(leaf).step) is _TORCH_ADAM_STEP)


def _hooked(leaf: torch.optim.Optimizer) -> bool:
    return bool(leaf._optimizer_step_pre_hooks or leaf._optimizer_step_post_hooks
                or torch_optimizer._global_optimizer_pre_hooks or torch_optimizer._global_optimizer_post_hooks)


def compiled_adam_step(opt) -> bool:
    """One :meth:`MainParamsOptimizer.step` (``prepare_grads`` + ``step_with_ready_grads``) as one traced
    region, or ``False`` (nothing done) where it does not apply; see the module docstring."""
    if not (opt._fusable_leaf and torch.compiler.is_compiling()):
        return False
    if getattr(opt, "grad_scale", None) is not None or getattr(opt, "found_inf", None) is not None:
        return False   # driven by GradScaler.step: the ordinary path unscales and skips
    leaf = opt.optimizer
    if _hooked(leaf) or leaf.defaults.get("differentiable"):
        return False
    # per (leaf group): [(main, model or None, grad source)] for the params with a grad
    plan = []
    for group, models, mains, fp32s in zip(leaf.param_groups, opt.float16_groups,
                                          opt.fp32_from_float16_groups, opt.fp32_from_fp32_groups):
        if group.get("fused") or group.get("differentiable"):
            return False
        entries = []
        for model, main in zip(models, mains):
            grad = getattr(model, "main_grad", None)
            if grad is None:
                grad = model.grad
            if grad is not None:
                entries.append((main, model, grad))
        for p in fp32s:
            grad = getattr(p, "main_grad", None)
            if grad is None:
                grad = p.grad
            if grad is not None:
                entries.append((p, None, grad))
        for main, _, grad in entries:
            state = leaf.state.get(main)
            if (not state or "exp_avg" not in state or (group["amsgrad"] and "max_exp_avg_sq" not in state)
                    or grad.is_sparse or local_tensor(grad).shape != local_tensor(main).shape):
                return False   # first step (state created there) or a grad the leaf must refuse
        plan.append(entries)
    _step(opt, leaf, plan)
    return True


@torch.no_grad()
def _step(opt, leaf: torch.optim.Optimizer, plan: list) -> None:
    opt._before_update()   # as step_with_ready_grads: model writes adopted, derived main params refreshed
    pairs = opt._low_precision_pairs()
    opt._released[:] = released_grads(pairs)
    for model, main in pairs:   # as prepare_grads; the grads are held in plan
        model.grad = None
        main.grad = None
    decoupled_default = isinstance(leaf, torch.optim.AdamW)
    for group, entries in zip(leaf.param_groups, plan):
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
        for main, model, grad in entries:
            local_main, local_grad = local_tensor(main), local_tensor(grad)
            cast = local_grad.dtype != local_main.dtype or local_grad.stride() != local_main.stride()
            if cast:   # handed to the update only, never stored: inductor fuses it into the update's reads
                local_grad = torch.empty_like(local_main).copy_(local_grad)   # fp32, or a float64/complex param's own
            if model is not None:
                if not cast:
                    main.grad = grad   # an fp32 main_grad is the main param's grad, no copy
            elif not cast and getattr(main, "main_grad", None) is not None:
                main.grad = grad
            state = leaf.state[main]
            if state["step"].device != local_main.device:
                state["step"] = state["step"].to(local_main.device)   # dynamo's move_step_if_cpu
            params.append(local_main)
            grads.append(local_grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            if group["amsgrad"]:
                max_exp_avg_sqs.append(state["max_exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            continue
        foreach = group["foreach"]
        if foreach is None:   # resolved on the params the leaf would see (their type decides it)
            _, foreach = _default_to_fused_or_foreach([main for main, _, _ in entries], False, use_fused=False)
        beta1, beta2 = group["betas"]
        torch_adam.adam(
            params, grads, local_tensors(exp_avgs), local_tensors(exp_avg_sqs), local_tensors(max_exp_avg_sqs),
            steps, foreach=foreach, capturable=True, differentiable=False, fused=None,
            grad_scale=getattr(leaf, "grad_scale", None), found_inf=getattr(leaf, "found_inf", None),
            has_complex=any(torch.is_complex(p) for p in params), amsgrad=group["amsgrad"],
            beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
            maximize=group["maximize"],
            decoupled_weight_decay=group.get("decoupled_weight_decay", decoupled_default))
    opt._finish_step(leaf.param_groups, eager=False)   # as step_with_ready_grads
