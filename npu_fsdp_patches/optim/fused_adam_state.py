"""FusedAdam optimizer states: layout, validation and low-precision scaling.

Every function takes the optimizer ``opt`` as its first argument and reads only the attributes of the
TE FusedAdam API (NVTE >= 2.1, docs/te_fused_adam.md#11-constructor): ``state``, ``_scales``,
``master_weights``, ``master_weight_dtype``, ``exp_avg_dtype``, ``exp_avg_sq_dtype``,
``store_param_remainders``, ``capturable``. So the same code serves the standalone
:class:`~npu_fsdp_patches.optim.fused_adam.FusedAdam` and an installed TE class patched by
``te_fused_adam_dtensor``.

Layout rule (docs/te_fused_adam.md#rfc-332-state-wrapping, #rfc-333-data-structures, NVTE >= 2.14): states
live on the param's *local* shard and are stored as DTensors with the param's mesh, placements, **global**
shape and stride; ``self.state`` and ``_scales`` stay keyed by the original param object. Scaling rule
(docs/te_fused_adam.md#rfc-335-scaling, docs/design.md#41-te_fused_adam_dtensor): FP16 states carry one
per-tensor scale ``s = max(absmax / (finfo(fp16).max / 2), finfo(fp32).tiny)``; a zero, non-finite or empty
state gets ``s = 1``; BF16 is stored unscaled; FP8 (uint8, plain tensors only) uses the same rule with the
E4M3 range 448.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .tensors import PLAIN_TYPES, is_foreign_dtensor, is_torch_dtensor, local_tensor, torch_dtensor_type

STATE_NAMES = ("exp_avg", "exp_avg_sq", "master_param")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_RANGE = {torch.float16: torch.finfo(torch.float16).max / 2.0, torch.uint8: 448.0}
_TINY = torch.finfo(torch.float32).tiny


# ----------------------------------------------------------------------------- layout

def wrap_like(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Re-wrap a local state tensor with ``param``'s mesh, placements, global shape and stride."""
    if not is_torch_dtensor(param):
        return value
    return torch_dtensor_type().from_local(
        value, device_mesh=param.device_mesh, placements=param.placements,
        shape=param.shape, stride=param.stride(), run_check=False)


def state_dtype(opt, name: str) -> torch.dtype:
    return {"exp_avg": opt.exp_avg_dtype, "exp_avg_sq": opt.exp_avg_sq_dtype,
            "master_param": opt.master_weight_dtype}[name]


def uses_remainders(opt, param: torch.Tensor) -> bool:
    """NVTE rule (docs/te_fused_adam.md#16-param-remainders): the int16 remainder replaces the fp32 master of
    bf16 params only."""
    return bool(opt.store_param_remainders) and param.dtype == torch.bfloat16


def describe(opt, param: torch.Tensor) -> str:
    """Name a param for error messages: its position in the param groups plus its layout."""
    where = "a param not held by this optimizer"
    for gi, group in enumerate(opt.param_groups):
        for pi, p in enumerate(group["params"]):
            if p is param:
                where = f"param {pi} of param group {gi}"
    kind = (f"DTensor placements={tuple(param.placements)} global shape={tuple(param.shape)}"
            if is_torch_dtensor(param) else f"tensor shape={tuple(param.shape)}")
    return f"{where} ({kind}, dtype={param.dtype})"


class DTensorRules(NamedTuple):
    """What the optimizer's configuration rules out for every DTensor param (read once per step)."""

    fp8_moment: Optional[str]   # the first moment stored as uint8 (FP8), if any
    no_bf16: bool               # master weights kept as int16 remainders of bf16 params
    capturable: bool


def dtensor_rules(opt) -> DTensorRules:
    fp8 = next((n for n in ("exp_avg", "exp_avg_sq") if state_dtype(opt, n) == torch.uint8), None)
    return DTensorRules(fp8, bool(opt.master_weights and opt.store_param_remainders), bool(opt.capturable))


def dtensor_problem(opt, param: torch.Tensor, rules: DTensorRules) -> Optional[Exception]:
    """Why the DTensor path cannot step the torch DTensor ``param``, as the error to raise, or None.

    The one predicate behind both :func:`check_dtensor_param` and the step's per-param check
    (docs/te_fused_adam.md#rfc-331-supported-types).
    """
    partial = next((pl for pl in param._spec.placements if pl.is_partial()), None)
    if partial is not None:
        return RuntimeError(f"FusedAdam: {describe(opt, param)} has Partial placement {partial}; "
                            "reduce it to Shard/Replicate before the optimizer step")
    loc = param._local_tensor
    if type(loc) not in PLAIN_TYPES:
        return RuntimeError(f"FusedAdam: {describe(opt, param)} wraps a quantized local tensor "
                            f"({type(loc).__name__}); quantized params are not supported on DTensor")
    if loc.dtype not in FLOAT_DTYPES:
        return RuntimeError(f"FusedAdam: {describe(opt, param)} has local dtype {loc.dtype}; the "
                            "DTensor path supports fp32, fp16 and bf16 params")
    if rules.fp8_moment is not None:
        return RuntimeError(f"FusedAdam: {rules.fp8_moment}_dtype=torch.uint8 (FP8 moments) is not "
                            f"supported for DTensor {describe(opt, param)}")
    if rules.no_bf16 and loc.dtype == torch.bfloat16:
        return RuntimeError(f"FusedAdam: store_param_remainders is not supported for DTensor "
                            f"{describe(opt, param)}; construct the optimizer with "
                            "store_param_remainders=False")
    if rules.capturable:
        return RuntimeError(f"FusedAdam: capturable=True is not supported for DTensor "
                            f"{describe(opt, param)}")
    return None


def check_dtensor_param(opt, param: torch.Tensor) -> None:
    """Reject what the DTensor path does not support, naming the param and the reason."""
    if is_foreign_dtensor(param):
        raise TypeError(f"FusedAdam: {describe(opt, param)} is a non-torch DTensor "
                        f"({type(param).__name__}); only torch.distributed.tensor.DTensor is supported")
    if not is_torch_dtensor(param):
        return
    problem = dtensor_problem(opt, param, dtensor_rules(opt))
    if problem is not None:
        raise problem


def check_plain_param(opt, param: torch.Tensor) -> None:
    """Refuse a plain param of a dtype the kernel cannot step, as TE's step does
    (docs/te_fused_adam.md#rfc-331-supported-types): complex params would lose their imaginary
    part and float64 params would be stepped in float32."""
    if param.dtype not in FLOAT_DTYPES:
        raise RuntimeError(f"FusedAdam only support model weights in fp32, fp16, bf16 and fp8: "
                           f"{describe(opt, param)} cannot be stepped (a complex param would lose its "
                           f"imaginary part, a float64 one would be stepped in float32); nothing was "
                           f"updated")


def check_grad(opt, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Return the local grad; a DTensor param needs a DTensor grad of the same layout
    (docs/te_fused_adam.md#rfc-334-grad-check)."""
    if grad.is_sparse:
        raise RuntimeError("FusedAdam does not support sparse gradients.")
    if not is_torch_dtensor(param):
        if is_torch_dtensor(grad):
            raise RuntimeError(f"FusedAdam: plain {describe(opt, param)} has a DTensor gradient")
        return grad
    if not is_torch_dtensor(grad):
        raise RuntimeError(f"FusedAdam: DTensor {describe(opt, param)} has a plain-tensor gradient "
                           f"of shape {tuple(grad.shape)}; a DTensor gradient with the same layout "
                           "is required")
    diffs = []
    if grad.device_mesh is not param.device_mesh and grad.device_mesh != param.device_mesh:
        diffs.append(f"device_mesh {grad.device_mesh} != {param.device_mesh}")
    if grad.placements != param.placements:
        diffs.append(f"placements {tuple(grad.placements)} != {tuple(param.placements)}")
    if grad.shape != param.shape:
        diffs.append(f"global shape {tuple(grad.shape)} != {tuple(param.shape)}")
    if diffs:
        raise RuntimeError(f"FusedAdam: the gradient of DTensor {describe(opt, param)} does not "
                           f"match the parameter layout: gradient " + "; ".join(diffs))
    return grad._local_tensor


# ----------------------------------------------------------------------------- scaling

def compute_scale(unscaled: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-tensor fp32 scale for ``dtype`` storage, without a host sync and without max on empty."""
    if unscaled.numel() == 0:
        return torch.ones([1], dtype=torch.float32, device=unscaled.device)
    lo, hi = torch.aminmax(unscaled)
    s = (torch.maximum(-lo, hi).float() / _RANGE[dtype]).reshape(1)
    good = torch.isfinite(s) & (s > 0)
    return torch.where(good, s.clamp(min=_TINY), torch.ones_like(s))


def _encode(unscaled: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    scaled = unscaled / scale
    if dtype == torch.uint8:
        return scaled.to(torch.float8_e4m3fn).view(torch.uint8)
    return scaled.to(dtype)


def _decode(stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.uint8:
        return stored.view(torch.float8_e4m3fn).float() * scale
    return stored.float() * scale


# ----------------------------------------------------------------------------- state access

def init_state(opt, param: torch.Tensor, name: str, zero: bool, remainders: bool = False) -> None:
    """Allocate one state on the param's local shard and store it re-wrapped (NVTE >= 2.14 layout)."""
    check_dtensor_param(opt, param)
    loc = local_tensor(param).detach()
    dtype = state_dtype(opt, name)
    if remainders:
        data = torch.zeros_like(loc, dtype=torch.int16)
    else:
        data = (torch.zeros_like if zero else torch.empty_like)(loc, dtype=dtype)
    opt.state[param][name] = wrap_like(param, data)
    if dtype != torch.float32 and not remainders:
        opt._scales.setdefault(param, {})[name] = torch.ones([1], dtype=torch.float32,
                                                             device=loc.device)


def get_unscaled(opt, param: torch.Tensor, name: str, skip_unscale: bool = False) -> torch.Tensor:
    """The state as a local fp32 tensor (the stored tensor itself when it is fp32).

    A bf16 state with ``skip_unscale`` comes back as the stored local bf16 tensor; the int16 master
    remainder of a bf16 param comes back raw (NVTE semantics).
    """
    stored = local_tensor(opt.state[param][name])
    dtype = state_dtype(opt, name)
    if name == "master_param" and stored.dtype == torch.int16:
        return stored
    if stored.dtype != dtype:
        raise RuntimeError(f"FusedAdam: {name} of {describe(opt, param)} is stored as "
                           f"{stored.dtype}, expected {dtype}")
    if dtype == torch.float32:
        return stored
    if unscale_skipped(stored, dtype, skip_unscale):
        return stored
    if dtype == torch.bfloat16:
        return stored.float()
    if dtype in (torch.float16, torch.uint8):
        return _decode(stored, opt._scales[param][name], dtype)
    raise RuntimeError(f"Dtype of {name} can only be fp8/fp16/bf16/fp32.")


def unscale_skipped(stored: torch.Tensor, dtype: torch.dtype, skip_unscale: bool) -> bool:
    """TE >= 2.13 ``get_unscaled_state(..., skip_unscale=True)``: a bf16 state comes back as stored."""
    return bool(skip_unscale) and dtype == torch.bfloat16 == stored.dtype


def set_scaled(opt, param: torch.Tensor, name: str, unscaled: torch.Tensor) -> None:
    """Store an unscaled fp32 value (or the int16 remainder) into the state, scaling as configured."""
    value = local_tensor(unscaled) if is_torch_dtensor(unscaled) else unscaled
    remainders = name == "master_param" and uses_remainders(opt, param)
    expected = torch.int16 if remainders else torch.float32
    if value.dtype != expected:
        raise TypeError(f"FusedAdam.set_scaled_state: {name} of {describe(opt, param)} must be "
                        f"given as {expected}, got {value.dtype}")
    loc_shape = local_tensor(param).shape
    if value.shape != loc_shape:
        raise RuntimeError(f"FusedAdam.set_scaled_state: {name} of {describe(opt, param)} has "
                           f"shape {tuple(value.shape)}, expected the local shape {tuple(loc_shape)}")
    if name not in opt.state[param]:
        init_state(opt, param, name, zero=False, remainders=remainders)
    stored = local_tensor(opt.state[param][name])
    dtype = state_dtype(opt, name)
    if remainders or dtype == torch.float32:
        stored.copy_(value)
    elif dtype == torch.bfloat16:
        stored.copy_(value.to(torch.bfloat16))
    else:
        scale = compute_scale(value, dtype)
        opt._scales[param][name].copy_(scale)
        stored.copy_(_encode(value, scale, dtype))


def resolve_remainders(opt, param: torch.Tensor, value: Optional[bool]) -> bool:
    """The ``store_param_remainders`` that ``initialize_state`` uses for ``param``
    (docs/design.md#42-te_initialize_state_compat).

    ``None`` derives it from the optimizer's configuration (effective only for bf16 params with fp32
    master weights); an explicit value that contradicts the configuration is a ``ValueError``.
    Without master weights the value is moot (no ``master_param`` is made) and any value is taken: a
    step passes ``store_param_remainders and bf16`` even after ``master_weights`` was turned off on a
    built optimizer (docs/te_fused_adam.md#22-initialize_state-call-sites).
    Read at call time, never cached.
    """
    derived = bool(opt.master_weights) and uses_remainders(opt, param)
    if value is None or bool(value) == derived or not opt.master_weights:
        return derived
    raise ValueError(
        f"initialize_state(store_param_remainders={value!r}) contradicts the optimizer "
        f"configuration for {describe(opt, param)}: remainders are stored only for bf16 params with "
        f"fp32 master weights and store_param_remainders=True (here master_weights="
        f"{bool(opt.master_weights)}, store_param_remainders={bool(opt.store_param_remainders)}), "
        f"so the value must be {derived}")


def initialize(opt, param: torch.Tensor, store_param_remainders: Optional[bool] = None) -> None:
    """Create ``exp_avg``, ``exp_avg_sq`` and, with master weights, ``master_param`` for ``param``."""
    remainders = resolve_remainders(opt, param, store_param_remainders)
    init_state(opt, param, "exp_avg", zero=True)
    init_state(opt, param, "exp_avg_sq", zero=True)
    if opt.master_weights:
        init_state(opt, param, "master_param", zero=False, remainders=remainders)
        if not remainders:
            set_scaled(opt, param, "master_param", local_tensor(param).detach().clone().float())
