"""One FusedAdam step on local shards (docs/te_fused_adam.md#rfc-336-update-paths to #rfc-338-empty-shards,
kernel math of docs/te_fused_adam.md#17-kernel-math).

Params are split per group into two paths:

* **direct**: fp32 param, fp32 grad, fp32 moments. The local tensors go straight into the fused AdamW
  kernel (``torch._fused_adamw_``), with no copy.
* **low precision**: anything else (fp16/bf16 params, master weights, fp16/bf16/fp8 moments). Moments
  are unscaled into fp32, the working weight is the fp32 master (or an fp32 copy of the param), the
  same kernel runs, then states are rescaled and the param is written back with a local ``copy_``.

The kernel is ``torch._fused_adamw_`` where the device has one (cpu, cuda, npu, ...) and a foreach
implementation of the same math elsewhere, or when ``bias_correction=False`` (which the torch kernel
cannot express). L2 mode (``adam_w_mode=False``) adds ``wd * w`` to a *copy* of the grad and runs the
kernel with zero decay. Every param gets its states on its first step, with or without a grad, as in
TE's step (Megatron-FSDP's dummy-step resume relies on it). Empty local shards are skipped, while every
group's ``step`` still advances on every rank. Flags (``master_weights``, ``use_decoupled_grad``, ...) are
read at step time. Nothing here issues a collective.
"""
from __future__ import annotations

from typing import List

import torch

from .fused_adam_state import (FLOAT_DTYPES, check_dtensor_param, check_grad, check_plain_param, dtensor_problem,
                               dtensor_rules, get_unscaled, initialize, set_scaled, state_dtype)
from .tensors import contiguous_operands, copy_back, is_foreign_dtensor, local_tensor, torch_dtensor_type

_F32 = torch.float32


def _fused_devices() -> List[str]:
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
        return list(_get_fused_kernels_supported_devices())
    except ImportError:  # pragma: no cover - older torch
        return ["cuda", "cpu", torch._C._get_privateuse1_backend_name()]


_FUSED_DEVICES = frozenset(_fused_devices())


def _foreach_adam(ws, gs, ms, vs, step, lr, beta1, beta2, eps, wd, bias_correction) -> None:
    """The fused kernel's AdamW math (docs/te_fused_adam.md#17-kernel-math) in foreach ops; used where
    no fused kernel exists."""
    bc1 = 1 - beta1 ** step if bias_correction else 1.0
    bc2 = 1 - beta2 ** step if bias_correction else 1.0
    torch._foreach_mul_(ms, beta1)
    torch._foreach_add_(ms, gs, alpha=1 - beta1)
    torch._foreach_mul_(vs, beta2)
    torch._foreach_addcmul_(vs, gs, gs, value=1 - beta2)
    denom = torch._foreach_div(vs, bc2)
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, eps)
    update = torch._foreach_div(ms, bc1)
    torch._foreach_div_(update, denom)
    if wd != 0:
        torch._foreach_add_(update, ws, alpha=wd)
    torch._foreach_add_(ws, update, alpha=-lr)


def adamw_kernel(ws, gs, ms, vs, *, step: int, lr: float, beta1: float, beta2: float, eps: float,
                 weight_decay: float, adam_w_mode: bool, bias_correction: bool) -> None:
    """Update fp32 lists ``ws``/``ms``/``vs`` in place from ``gs``; ``gs`` is never modified.
    Any memory layout works: non-contiguous operands are stepped as contiguous copies
    (:func:`~.tensors.contiguous_operands`)."""
    if not ws:
        return
    (ws, gs, ms, vs), write_back = contiguous_operands([ws, gs, ms, vs], read_only=(1,))
    if not adam_w_mode and weight_decay != 0:
        gs = torch._foreach_add(gs, ws, alpha=weight_decay)  # L2 on a copy of the grads
        weight_decay = 0.0
    elif not adam_w_mode:
        weight_decay = 0.0
    by_device = {}
    for i, w in enumerate(ws):
        by_device.setdefault(w.device, []).append(i)
    for device, idx in by_device.items():
        sel = (ws, gs, ms, vs) if len(by_device) == 1 else tuple([t[i] for i in idx]
                                                              for t in (ws, gs, ms, vs))
        if bias_correction and device.type in _FUSED_DEVICES:
            step_t = torch.tensor(float(step), dtype=_F32, device=device)
            torch._fused_adamw_(*sel, [], [step_t] * len(idx), lr=lr, beta1=beta1, beta2=beta2,
                                weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
        else:
            _foreach_adam(*sel, step, lr, beta1, beta2, eps, weight_decay, bias_correction)
    copy_back(write_back)


# ----------------------------------------------------------------------------- bf16 remainders

def merge_remainders(param16: torch.Tensor, rem: torch.Tensor) -> torch.Tensor:
    """fp32 master from bf16 bits + int16 remainder (docs/te_fused_adam.md#16-param-remainders)."""
    hi = param16.view(torch.int16).to(torch.int64) - (rem < 0).to(torch.int64)
    bits = ((hi & 0xFFFF) << 16) | (rem.to(torch.int64) & 0xFFFF)
    bits = bits - (bits >= 2 ** 31).to(torch.int64) * 2 ** 32
    return bits.to(torch.int32).view(_F32)


def split_remainders(master: torch.Tensor, param16: torch.Tensor, rem: torch.Tensor) -> None:
    """Write the bf16 param (round to nearest) and the int16 remainder of an fp32 master."""
    bits = master.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    lo = bits & 0xFFFF
    lo = lo - (lo >= 0x8000).to(torch.int64) * 0x10000
    hi = ((bits >> 16) + (lo < 0).to(torch.int64)) & 0xFFFF
    hi = hi - (hi >= 0x8000).to(torch.int64) * 0x10000
    param16.view(torch.int16).copy_(hi.to(torch.int16))
    rem.copy_(lo.to(torch.int16))


# ----------------------------------------------------------------------------- the step

def _grad_of(opt, p):
    return getattr(p, "decoupled_grad", None) if opt.use_decoupled_grad else p.grad


def _same_layout(a, b) -> bool:
    """Fast equality of two DTensorSpecs (mesh, placements, global shape); False means "look closer"."""
    return a is b or (a.mesh is b.mesh and a.placements == b.placements and a.shape == b.shape)


def _step_group(opt, group: dict, items: list) -> None:
    """Step one group over its prepared ``(param, local param, local grad or None)`` items
    (:func:`_prepare` checked them all)."""
    beta1, beta2 = group["betas"]
    hyper = dict(step=group["step"], lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                 weight_decay=group["weight_decay"], adam_w_mode=bool(opt.adam_w_mode),
                 bias_correction=bool(group.get("bias_correction", True)))
    moments_fp32 = state_dtype(opt, "exp_avg") == _F32 and state_dtype(opt, "exp_avg_sq") == _F32
    direct = ([], [], [], [])
    low = []
    for p, pl, g in items:
        state = opt.state[p]
        if len(state) == 0:
            initialize(opt, p)  # as TE's step: grad-less params get states too
        if g is None:
            continue
        if pl.numel() == 0:
            continue  # empty shard: state exists, no kernel input, group step already advanced
        if pl.dtype == _F32 and g.dtype == _F32 and moments_fp32:
            m, v = state["exp_avg"], state["exp_avg_sq"]
            if pl is not p:  # DTensor param: its states are DTensors too
                m, v = m._local_tensor, v._local_tensor
            for lst, t in zip(direct, (pl, g, m, v)):
                lst.append(t)
        else:
            low.append((p, pl, g))
    adamw_kernel(*direct, **hyper)
    _low_precision(opt, low, hyper)
    _refresh_fp32_masters(opt, group)


def _low_precision(opt, items, hyper) -> None:
    if not items:
        return
    ws, gs, ms, vs, after = [], [], [], [], []
    for p, pl, g in items:
        state = opt.state[p]
        m, v = get_unscaled(opt, p, "exp_avg"), get_unscaled(opt, p, "exp_avg_sq")
        rem = None
        if pl.dtype == _F32:
            w = pl
        elif opt.master_weights:
            rem_state = local_tensor(state["master_param"])
            if rem_state.dtype == torch.int16:
                rem, w = rem_state, merge_remainders(pl, rem_state)
            else:
                w = get_unscaled(opt, p, "master_param")
        else:
            w = pl.float()
        ws.append(w)
        gs.append(g if g.dtype == _F32 else g.float())
        ms.append(m)
        vs.append(v)
        after.append((p, pl, w, m, v, rem))
    adamw_kernel(ws, gs, ms, vs, **hyper)
    for p, pl, w, m, v, rem in after:
        for name, value in (("exp_avg", m), ("exp_avg_sq", v)):
            if state_dtype(opt, name) != _F32:
                set_scaled(opt, p, name, value)
        if pl.dtype == _F32:
            continue
        if rem is not None:
            split_remainders(w, pl, rem)
            continue
        if opt.master_weights and state_dtype(opt, "master_param") != _F32:
            set_scaled(opt, p, "master_param", w)
        pl.copy_(w)


def _refresh_fp32_masters(opt, group) -> None:
    """fp32 params update in place (NVTE); keep a master copy they carry in step for checkpoints."""
    if not opt.master_weights:
        return
    for p in group["params"]:
        state = opt.state.get(p)
        if (state and "master_param" in state and p.dtype == _F32 and _grad_of(opt, p) is not None
                and local_tensor(p).numel()):
            set_scaled(opt, p, "master_param", local_tensor(p).detach().clone())


def _prepare(opt) -> list:
    """Every per-param check of the step, for all groups, before the first write (no group's
    ``step`` advanced, no state made: validate, then commit), done once: per group, the
    ``(param, local param, local grad or None)`` items :func:`_step_group` steps."""
    rules = dtensor_rules(opt)   # per step, not per param: what the configuration rules out
    dtensor_cls = torch_dtensor_type()
    prepared = []
    for group in opt.param_groups:
        items = []
        for p in group["params"]:
            pl = p
            if dtensor_cls is not None and isinstance(p, dtensor_cls):
                pl = p._local_tensor
                problem = dtensor_problem(opt, p, rules)
                if problem is not None:
                    raise problem   # names the param and the reason
            elif is_foreign_dtensor(p):
                check_dtensor_param(opt, p)  # raises: only torch DTensors are supported
            elif p.dtype not in FLOAT_DTYPES:
                check_plain_param(opt, p)
            grad, g = _grad_of(opt, p), None
            if grad is not None:
                if (pl is not p and isinstance(grad, dtensor_cls) and not grad.is_sparse
                        and _same_layout(grad._spec, p._spec)):
                    g = grad._local_tensor
                else:
                    g = check_grad(opt, p, grad)
            items.append((p, pl, g))
        prepared.append(items)
    return prepared


def _step_groups(opt) -> None:
    prepared = _prepare(opt)
    with torch.no_grad():
        for group, items in zip(opt.param_groups, prepared):
            group["step"] = int(group.get("step", 0)) + 1
            _step_group(opt, group, items)


#: The step as dynamo sees it: never traced. torch's compiled ``AdamW(fused=True)`` traces nothing either
#: (dynamo wraps ``torch.optim.adam._fused_adam`` in ``disable``, torch/_dynamo/eval_frame.py, and graph-breaks
#: around it). Traced, this step fails (functionalization cannot express ``torch._fused_adamw_``'s in-place
#: update: "mutating a non-functional tensor with a functional tensor") and would recompile every step (the
#: int ``group["step"]`` and fresh grads keyed through ``opt.state`` are guarded). ``torch._disable_dynamo``
#: imports dynamo only on its first call, so eager users never pay for it (a torch without it steps traced).
_step_groups_untraced = getattr(torch, "_disable_dynamo", lambda fn: fn)(_step_groups)


def adam_step(opt, closure=None, grad_scaler=None):
    """One step over all groups; ``grad_scaler`` is accepted for API parity and unused, as in TE's
    non-capturable path. Returns the closure's loss. Under ``torch.compile`` the closure is traced and the
    update runs eagerly behind one graph break (docs/performance.md#compiled-steps), so compiled bits equal
    eager bits."""
    if opt.capturable:
        raise RuntimeError("FusedAdam: capturable=True is not supported by the DTensor-aware step")
    loss = closure() if closure is not None else None
    if torch.compiler.is_compiling():
        _step_groups_untraced(opt)
    else:
        _step_groups(opt)
    return loss
