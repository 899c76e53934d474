"""A DTensor-aware, device-agnostic FusedAdam with the TE (NVTE >= 2.1) API (docs/design.md#41-te_fused_adam_dtensor).

Drop-in for ``transformer_engine.pytorch.optimizers.FusedAdam`` on any device with a
``torch._fused_adamw_`` kernel (cpu, cuda, npu), falling back to foreach ops elsewhere. DTensor params
(``Shard``/``Replicate``) are updated on their local shards with no collective; their states are
DTensors with the param's layout. The numerics live in ``fused_adam_state`` / ``fused_adam_step`` /
``fused_adam_checkpoint``, which the ``te_fused_adam_dtensor`` patch also grafts onto an installed TE
class.
"""
from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Optional

import torch

from . import fused_adam_checkpoint, fused_adam_state, fused_adam_step

_STATE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.uint8)


class FusedAdam(torch.optim.Optimizer):
    """Adam / AdamW (``adam_w_mode``) with TE's options: master weights, low-precision moments,
    ``decoupled_grad`` and bf16 param remainders (plain tensors only).

    Not supported, as in TENPU: ``amsgrad``, ``capturable`` (both raise ``RuntimeError``). Per-param
    rejections on DTensor: ``Partial`` placements, quantized locals, uint8/FP8 moments and
    ``store_param_remainders``.
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter | dict],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        bias_correction=True,
        adam_w_mode=True,
        capturable=False,
        master_weights=False,
        master_weight_dtype=torch.float32,
        exp_avg_dtype=torch.float32,
        exp_avg_sq_dtype=torch.float32,
        use_decoupled_grad=False,
        store_param_remainders=False,
        set_grad_none: Optional[bool] = None,
    ):
        effective_remainders = _check_options(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, capturable=capturable,
            master_weights=master_weights, master_weight_dtype=master_weight_dtype, exp_avg_dtype=exp_avg_dtype,
            exp_avg_sq_dtype=exp_avg_sq_dtype, store_param_remainders=store_param_remainders)
        defaults = {"lr": lr, "bias_correction": bias_correction, "betas": betas, "eps": eps,
                    "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.capturable = capturable
        self.master_weights = master_weights
        self.master_weight_dtype = master_weight_dtype
        self.exp_avg_dtype = exp_avg_dtype
        self.exp_avg_sq_dtype = exp_avg_sq_dtype
        self.name_to_dtype_map = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype,
                                  "master_param": master_weight_dtype}
        self._scales = {}
        self.use_decoupled_grad = use_decoupled_grad
        self.store_param_remainders = effective_remainders
        self.set_grad_none = set_grad_none
        if set_grad_none is not None:
            warnings.warn("set_grad_none kwarg in FusedAdam constructor is deprecated. "
                          "Use set_to_none kwarg in zero_grad instead.", DeprecationWarning)

    def add_param_group(self, param_group: dict) -> None:
        """As torch's, plus ``step = 0`` so a fresh state_dict is a complete DCP load template."""
        super().add_param_group(param_group)
        self.param_groups[-1].setdefault("step", 0)

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """Reset ``grad`` (or ``decoupled_grad``); ``set_to_none`` defaults to True (TE semantics)."""
        if self.set_grad_none is not None:
            if set_to_none is not None and set_to_none != self.set_grad_none:
                raise ValueError(f"Called zero_grad with set_to_none={set_to_none}, but FusedAdam "
                                 f"was initialized with set_grad_none={self.set_grad_none}")
            set_to_none = self.set_grad_none
        if set_to_none is None:
            set_to_none = True
        if not self.use_decoupled_grad:
            super().zero_grad(set_to_none=set_to_none)
            return
        for group in self.param_groups:
            for p in group["params"]:
                if set_to_none:
                    p.decoupled_grad = None
                elif getattr(p, "decoupled_grad", None) is not None:
                    p.decoupled_grad.zero_()

    def initialize_state(self, param, store_param_remainders=None) -> None:
        """Create the states of ``param``. ``store_param_remainders=None`` derives the value from the
        configuration; an explicit contradicting value raises ``ValueError``."""
        fused_adam_state.initialize(self, param, store_param_remainders)

    def get_unscaled_state(self, param: torch.nn.Parameter, state_name: str,
                           skip_unscale: bool = False) -> torch.Tensor:
        """The local fp32 value of a state (bf16 as stored with ``skip_unscale=True``)."""
        return fused_adam_state.get_unscaled(self, param, state_name, skip_unscale)

    def set_scaled_state(self, param, state_name, unscaled_state):
        """Store an unscaled fp32 value, scaling it to the state's dtype."""
        fused_adam_state.set_scaled(self, param, state_name, unscaled_state)

    def state_dict(self):
        """TE semantics: states unscaled to fp32; DTensor params' states keep their layout."""
        return fused_adam_checkpoint.export_state(self, super().state_dict())

    def load_state_dict(self, state_dict):
        """Restore param groups and states, re-scaled to the configured dtypes."""
        fused_adam_checkpoint.import_state(self, state_dict)

    def step(self, closure=None, grad_scaler=None):
        """One Adam/AdamW step; ``grad_scaler`` is accepted for API parity and unused."""
        return fused_adam_step.adam_step(self, closure, grad_scaler)


def _check_options(*, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                   amsgrad: bool, capturable: bool, master_weights: bool, master_weight_dtype: torch.dtype,
                   exp_avg_dtype: torch.dtype, exp_avg_sq_dtype: torch.dtype,
                   store_param_remainders: bool) -> bool:
    """Raise the constructor's errors, in TE's order and wording (docs/te_fused_adam.md#12-constructor-errors);
    return whether param remainders take effect (only with fp32 master weights)."""
    if amsgrad:
        raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
    if master_weights and master_weight_dtype not in (torch.float32, torch.float16):
        raise RuntimeError("FusedAdam only supports fp32/fp16 master weights.")
    if exp_avg_dtype not in _STATE_DTYPES:
        raise RuntimeError("FusedAdam only supports fp32/fp16/bf16/fp8 exp_avg.")
    if exp_avg_sq_dtype not in _STATE_DTYPES:
        raise RuntimeError("FusedAdam only supports fp32/fp16/bf16/fp8 exp_avg_sq.")
    if capturable and master_weights and master_weight_dtype != torch.float32:
        raise RuntimeError("Capturable mode only supports fp32 master weights.")
    if capturable and not (exp_avg_dtype == exp_avg_sq_dtype
                           and exp_avg_dtype in (torch.float32, torch.bfloat16)):
        raise RuntimeError(
            "Capturable mode requires exp_avg_dtype and exp_avg_sq_dtype to be both "
            "torch.float32 or both torch.bfloat16, got "
            f"exp_avg_dtype={exp_avg_dtype} and exp_avg_sq_dtype={exp_avg_sq_dtype}.")
    effective_remainders = bool(store_param_remainders and master_weights
                                and master_weight_dtype == torch.float32)
    if capturable and effective_remainders:
        raise RuntimeError("Capturable mode doesn't support storing param remainders")
    if capturable:
        raise RuntimeError("FusedAdam (npu_fsdp_patches) does not support capturable=True: "
                           "CUDA-graph capture of the optimizer step is not implemented")
    for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
        if value < 0.0:
            raise ValueError(f"Invalid {name}: {value}")
    if not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"Invalid betas: {betas}")
    return effective_remainders
