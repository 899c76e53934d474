"""Muon + AdamW param routing and a minimal chained optimizer (docs/hyper_parallel.md#rfc-001-7-optimizers,
docs/hyper_parallel.md#14-optimizers, #16-trainer).

Routing rule (hyper-parallel's ``Muon`` builder): matrix weights go to Muon; embeddings, output
heads and biases stay with AdamW. ``torch.optim.Muon`` handles 2-D params only, so the rule here
is ``ndim == 2`` and a name not matching ``embed|lm_head|out_head|out_proj.bias``.

:class:`OptimizerChain` steps its children in order and exposes ``chained_optimizers`` and
``optimizers_dict`` like hyper-parallel's ``ChainedOptimizer``, so :class:`MainParamsOptimizer`
wraps it directly. It holds nothing keyed by param, so the main-param swap needs no cache rebuild.
"""
from __future__ import annotations

import re
from typing import Any, Iterable

import torch
from torch import nn

ADAMW_NAME_PATTERN = re.compile(r"embed|lm_head|out_head|out_proj\.bias")

__all__ = ["is_muon_param", "split_muon_adamw_params", "OptimizerChain", "build_muon_adamw",
           "torch_muon_class"]


def is_muon_param(name: str, param: torch.Tensor) -> bool:
    """True for a 2-D weight that is not an embedding, head or bias."""
    return param.ndim == 2 and not ADAMW_NAME_PATTERN.search(name)


def split_muon_adamw_params(named_params: Iterable[tuple[str, nn.Parameter]]
                            ) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(muon_params, adamw_params) among the trainable ``named_params``."""
    muon, adamw = [], []
    for name, p in named_params:
        if p.requires_grad:
            (muon if is_muon_param(name, p) else adamw).append(p)
    return muon, adamw


class OptimizerChain:
    """Steps a fixed set of optimizers as one; ``param_groups`` spans them all."""

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer]) -> None:
        if not optimizers:
            raise ValueError("OptimizerChain needs at least one optimizer")
        self.optimizers_dict = dict(optimizers)
        self.chained_optimizers = list(self.optimizers_dict.values())

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.chained_optimizers for g in opt.param_groups]

    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        for opt in self.chained_optimizers:
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.chained_optimizers:
            opt.zero_grad(set_to_none=set_to_none)


def torch_muon_class() -> type:
    """``torch.optim.Muon``; a clear error on torch < 2.9, which has none (docs/torch_adam.md#7-muon)."""
    muon = getattr(torch.optim, "Muon", None)
    if muon is None:
        raise RuntimeError(f"torch.optim.Muon needs torch >= 2.9 (this is torch {torch.__version__}); "
                           f"on this torch route every param to AdamW, or use a Muon implementation "
                           f"that provides reset_optimizer_parameters()")
    return muon


def build_muon_adamw(model: nn.Module, *, muon_kwargs: dict | None = None,
                     adamw_kwargs: dict | None = None) -> OptimizerChain:
    """``OptimizerChain({"adamw": AdamW, "muon": Muon})`` over ``model`` by the routing rule.

    Either child is left out when no param is routed to it. Raises ``RuntimeError`` naming the
    torch version when a param is routed to Muon on torch < 2.9 (no ``torch.optim.Muon``).
    """
    muon_params, adamw_params = split_muon_adamw_params(model.named_parameters())
    optimizers: dict[str, torch.optim.Optimizer] = {}
    if adamw_params:
        optimizers["adamw"] = torch.optim.AdamW(adamw_params, **(adamw_kwargs or {}))
    if muon_params:
        optimizers["muon"] = torch_muon_class()(muon_params, **(muon_kwargs or {}))
    return OptimizerChain(optimizers)
