"""FP32 ``main_param`` wrapper for low-precision models (docs/design.md#43-hp_fp32_main_params,
docs/hyper_parallel.md#rfc-001-7-optimizers to #rfc-001-9-checkpoints).

A bf16/fp16 model loses small updates when the optimizer writes straight into low-precision
params. :class:`MainParamsOptimizer` gives every bf16/fp16 param its own fp32 ``main_param``,
swaps it into the leaf optimizers' param groups (existing state moves with it), and runs

    prepare_grads()          main_param.grad = p.main_grad (fp32) or p.grad.float(); p.grad = None
    step_with_ready_grads()  leaf optimizers step on the main params, then main -> model params

The update formulas of the leaf optimizers (AdamW, Muon, ...) are untouched: they simply see fp32
params. FP32 params are their own main param (``p.main_param is p``), with no copy.

Params may be plain tensors, torch DTensors (``fully_shard``) or hyper-parallel DTensors. Copies
between model and main params go local shard to local shard, so no collective is added and
hyper DTensors (whose ops fail outside ``SkipDTensorDispatch``) are never dispatched on: only the
leaf optimizers' step needs that context (``with SkipDTensorDispatch(): opt.step()``, as hyper's
trainer runs it); construction, ``prepare_grads``, ``zero_grad`` and the state dict work outside.

State dicts are keyed by model-param FQN (the layout of torch's ``get_optimizer_state_dict``), plus
``_mixed_precision_optimizer.fp32_from_fp16_params = {fqn: fp32 main_param}`` for the
low-precision params only. See :mod:`.main_params_checkpoint` for DCP save/load.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

from ._leaf_views import LeafParamGroups, LeafState, ReadOnlyDefaults
from ._main_params_state import leaf_state_dict_by_fqn, load_leaf_state_dicts
from ._param_identity import stale_param_references
from ._optimizer_contract import init_optimizer_contract, run_load_state_dict_hooks, run_state_dict_hooks
from .tensors import is_foreign_dtensor, is_torch_dtensor, local_tensor, local_tensors

MP_KEY = "_mixed_precision_optimizer"
MAIN_PARAMS_KEY = "fp32_from_fp16_params"
LOW_PRECISION = (torch.float16, torch.bfloat16)

__all__ = ["MainParamsOptimizer", "Float16OptimizerWithFloat16Params", "leaf_optimizers"]


def leaf_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The leaf optimizers behind ``optimizer``: one optimizer, a list/dict, or a chained optimizer.

    Chained optimizers are recognised by ``chained_optimizers`` (hyper-parallel ChainedOptimizer)
    or ``optimizers_dict`` (hyper-parallel, veomni MultiOptimizer).
    """
    if isinstance(optimizer, dict):
        children = list(optimizer.values())
    elif isinstance(optimizer, (list, tuple)):
        children = list(optimizer)
    elif getattr(optimizer, "chained_optimizers", None) is not None:
        children = list(optimizer.chained_optimizers)
    elif getattr(optimizer, "optimizers_dict", None) is not None:
        children = list(optimizer.optimizers_dict.values())
    elif isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    else:
        raise TypeError(f"expected a torch optimizer, a list/dict of optimizers or a chained "
                        f"optimizer, got {type(optimizer).__name__}")
    leaves = [leaf for child in children for leaf in leaf_optimizers(child)]
    if not leaves:
        raise ValueError("the chained optimizer holds no optimizers")
    return leaves


#: main params and their grads are contiguous on every rank: torch's fused optimizer kernels pair
#: param, grad and state elements by memory position, so a leaf AdamW(fused=True) needs one layout
_CONTIGUOUS_FP32 = dict(dtype=torch.float32, memory_format=torch.contiguous_format)


def _fp32_main_param(p: torch.Tensor) -> nn.Parameter:
    """A new contiguous fp32 Parameter with ``p``'s values and DTensor layout (local shard copied,
    never gathered)."""
    if is_foreign_dtensor(p):
        # nn.Parameter(dt) would call dt.detach(), an op hyper-parallel dispatches (and refuses
        # outside SkipDTensorDispatch). Build the leaf on the local shard instead, wrap it (the
        # wrapper takes requires_grad from it), and flag it as nn.Parameter does for subclasses.
        local = local_tensor(p).detach().to(copy=True, **_CONTIGUOUS_FP32).requires_grad_(p.requires_grad)
        main = type(p).from_local(local, p.device_mesh, p.placements)
        main._is_param = True   # isinstance(main, nn.Parameter), see torch.nn.parameter._ParameterMeta
        return main
    if is_torch_dtensor(p):   # copy the local shard: no DTensor dispatch, no collective
        local = local_tensor(p).detach().to(copy=True, **_CONTIGUOUS_FP32)
        main = type(p).from_local(local, p.device_mesh, p.placements, run_check=False,
                                  shape=p.shape, stride=p.stride())
        return nn.Parameter(main, requires_grad=p.requires_grad)
    return nn.Parameter(p.detach().to(copy=True, **_CONTIGUOUS_FP32), requires_grad=p.requires_grad)


def _fp32_grad(grad: torch.Tensor) -> torch.Tensor:
    """``grad`` as a contiguous fp32 local shard with its DTensor layout kept; a contiguous fp32
    grad is returned as is (no copy)."""
    local = local_tensor(grad)
    if grad.dtype == torch.float32 and local.is_contiguous():
        return grad
    cast = local.to(**_CONTIGUOUS_FP32)
    if is_foreign_dtensor(grad):
        return type(grad).from_local(cast, grad.device_mesh, grad.placements)
    if is_torch_dtensor(grad):   # cast the local shard: skips DTensor dispatch, adds no collective
        return type(grad).from_local(cast, grad.device_mesh, grad.placements,
                                     run_check=False, shape=grad.shape, stride=grad.stride())
    return cast


class MainParamsOptimizer(torch.optim.Optimizer):
    """Megatron-style fp32 main-param composition over one or more leaf optimizers.

    Args:
        optimizer: a torch optimizer, a list or dict of them, or a chained optimizer exposing
            ``chained_optimizers``/``optimizers_dict``.
        model: the module owning the params; gives every param its FQN (state-dict keys).

    ``param_groups``, ``state`` and ``defaults`` are views of the leaf optimizers (the groups now
    hold the main params): writes reach the leaf that owns the param or group, and writes that
    could not take effect (new groups, new defaults, reassigning the attributes) are refused.
    So LR schedulers, grad clipping and ``zero_grad`` behave as on a plain optimizer, and step and
    state-dict hooks (instance and global) fire as on a plain optimizer. :meth:`step` fires the
    step hooks; the split Megatron calls (:meth:`prepare_grads`, :meth:`step_with_ready_grads`)
    do not, as on Megatron's own optimizer. Global step hooks also see the leaf optimizers'
    own steps, as with torch's ``ZeroRedundancyOptimizer``, which also steps an inner optimizer.
    """

    def __init__(self, optimizer: Any, model: nn.Module) -> None:
        init_optimizer_contract(self)   # Optimizer.__init__ minus params: they live in the leaves
        self.optimizer = optimizer
        self.model = model
        self.leaf_optimizers = leaf_optimizers(optimizer)
        self._state_view = LeafState(self.leaf_optimizers, self._describe_non_optimizer_param)

        fqn_by_id = {}
        for name, p in model.named_parameters():
            fqn_by_id.setdefault(id(p), name)
        self.float16_groups: list[list[nn.Parameter]] = []
        self.fp32_from_float16_groups: list[list[nn.Parameter]] = []
        self.fp32_from_fp32_groups: list[list[nn.Parameter]] = []
        self._model_param_by_id: dict[int, nn.Parameter] = {}   # optimizer (main) param -> model param
        self._main_param_by_id: dict[int, nn.Parameter] = {}    # model param -> main param
        self._fqn_by_id: dict[int, str] = {}                    # model or main param -> FQN
        for leaf in self.leaf_optimizers:
            for g, group in enumerate(leaf.param_groups):
                self._wrap_group(leaf, g, group, fqn_by_id)
        self._rebuild_param_caches()

    # ---- construction -------------------------------------------------------------------------
    def _wrap_group(self, leaf, g: int, group: dict, fqn_by_id: dict) -> None:
        float16, fp32_from_float16, fp32_from_fp32 = [], [], []
        for i, p in enumerate(group["params"]):
            fqn = fqn_by_id.get(id(p))
            where = f"param {i} of group {g} of {type(leaf).__name__}"
            if fqn is None:
                raise ValueError(f"{where} is not a parameter of the model, so it has no FQN")
            if id(p) in self._main_param_by_id:
                raise ValueError(f"parameter {fqn!r} appears in more than one param group")
            if p.dtype in LOW_PRECISION:
                main = _fp32_main_param(p)
                group["params"][i] = main
                if p in leaf.state:
                    leaf.state[main] = leaf.state.pop(p)
                float16.append(p)
                fp32_from_float16.append(main)
            elif p.dtype == torch.float32:
                main = p
                fp32_from_fp32.append(p)
            else:
                raise TypeError(f"parameter {fqn!r} has dtype {p.dtype}; MainParamsOptimizer "
                                f"supports float16, bfloat16 and float32 params only")
            p.main_param = main
            self._model_param_by_id[id(main)] = p
            self._main_param_by_id[id(p)] = main
            self._fqn_by_id[id(p)] = self._fqn_by_id[id(main)] = fqn
        self.float16_groups.append(float16)
        self.fp32_from_float16_groups.append(fp32_from_float16)
        self.fp32_from_fp32_groups.append(fp32_from_fp32)

    def _rebuild_param_caches(self) -> None:
        """Let optimizers that cache param identity (older hyper-parallel Muon) see the main params.

        A chained optimizer with ``reset_optimizer_parameters(mapping)`` gets the
        main-param -> model-param mapping (hyper-parallel's contract); otherwise each leaf that
        has ``reset_optimizer_parameters()`` rebuilds itself. Then every leaf's attributes other
        than ``state``/``param_groups`` are searched for the swapped-out low-precision params (or
        their ``id()``): a leaf still holding one is refused, since it would keep using them.
        Optimizers that key only ``state`` by param (torch ``Muon``, veomni ``DistributedMuon``,
        AdamW) pass whatever their name.
        """
        reset = getattr(self.optimizer, "reset_optimizer_parameters", None)
        if reset is not None and self.optimizer not in self.leaf_optimizers:
            reset({main: self._model_param_by_id[id(main)] for main in self._main_params()})
        else:
            for leaf in self.leaf_optimizers:
                if callable(getattr(leaf, "reset_optimizer_parameters", None)):
                    leaf.reset_optimizer_parameters()
        swapped = {id(model): self.fqn(model) for model, _ in self._low_precision_pairs()}
        for leaf in self.leaf_optimizers:
            stale = stale_param_references(leaf, swapped) if swapped else []
            if stale:
                raise TypeError(
                    f"{type(leaf).__module__}.{type(leaf).__name__} keeps references to "
                    f"low-precision params outside its state and param_groups ({'; '.join(stale)}), "
                    f"and after the swap to fp32 main params they would still point at the "
                    f"low-precision params. Give it a reset_optimizer_parameters() that rebuilds "
                    f"them from param_groups, or build it so that it keys only `state` by param "
                    f"(as torch.optim.Muon does).")

    # ---- iteration helpers -----------------------------------------------------------------------
    def _low_precision_pairs(self) -> Iterator[tuple[nn.Parameter, nn.Parameter]]:
        for model_group, main_group in zip(self.float16_groups, self.fp32_from_float16_groups):
            yield from zip(model_group, main_group)

    def _fp32_params(self) -> Iterator[nn.Parameter]:
        for group in self.fp32_from_fp32_groups:
            yield from group

    def _main_params(self) -> Iterator[nn.Parameter]:
        for leaf in self.leaf_optimizers:
            for group in leaf.param_groups:
                yield from group["params"]

    def model_param(self, main_param: torch.Tensor) -> nn.Parameter:
        """The model param that ``main_param`` (an optimizer param) stands for."""
        return self._model_param_by_id[id(main_param)]

    def main_param(self, model_param: torch.Tensor) -> nn.Parameter:
        """The optimizer param (main param) of ``model_param``."""
        return self._main_param_by_id[id(model_param)]

    def fqn(self, param: torch.Tensor) -> str:
        """The model FQN of a model param or of its main param."""
        return self._fqn_by_id[id(param)]

    # ---- Optimizer surface ---------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict]:
        return LeafParamGroups(self.leaf_optimizers, type(self).__name__)

    @param_groups.setter
    def param_groups(self, value: Any) -> None:
        self._refuse_assignment("param_groups")

    @property
    def state(self) -> LeafState:
        return self._state_view

    @state.setter
    def state(self, value: Any) -> None:
        self._refuse_assignment("state")

    @property
    def defaults(self) -> ReadOnlyDefaults:
        return ReadOnlyDefaults(self.leaf_optimizers[0].defaults, type(self).__name__)

    @defaults.setter
    def defaults(self, value: Any) -> None:
        self._refuse_assignment("defaults")

    def _refuse_assignment(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__}.{name} is a view of the wrapped optimizers and "
                             f"cannot be reassigned; change the leaf optimizers before wrapping them, "
                             f"or use load_state_dict()")

    def _describe_non_optimizer_param(self, param: Any) -> str:
        if id(param) in self._main_param_by_id:
            return (f"model param {self.fqn(param)!r} (its optimizer state is keyed by its fp32 "
                    f"main param: optimizer.state[optimizer.main_param(model_param)])")
        return f"a {type(param).__name__} that is no param of the wrapped optimizers"

    def __repr__(self) -> str:
        leaves = ", ".join(type(leaf).__name__ for leaf in self.leaf_optimizers)
        return f"{type(self).__name__}({leaves})"

    def add_param_group(self, param_group: dict) -> None:
        raise NotImplementedError("add param groups to the leaf optimizer before wrapping it")

    # ---- step lifecycle --------------------------------------------------------------------
    @torch.no_grad()
    def prepare_grads(self) -> None:
        """Hand each main param its fp32 grad: ``main_grad`` first, else ``grad.float()``."""
        for model_param, main_param in self._low_precision_pairs():
            grad = getattr(model_param, "main_grad", None)
            if grad is None:
                grad = model_param.grad
            main_param.grad = None if grad is None else _fp32_grad(grad)
            model_param.grad = None
        for p in self._fp32_params():
            main_grad = getattr(p, "main_grad", None)
            if main_grad is not None:
                p.grad = _fp32_grad(main_grad)

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        """Step the leaf optimizers on the main params, then copy main -> model params."""
        if isinstance(self.optimizer, (list, tuple, dict)):
            for leaf in self.leaf_optimizers:
                leaf.step()
        else:
            self.optimizer.step()   # a chained optimizer keeps its own step order
        self._copy_main_params_to_model_params()
        return True

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.prepare_grads()
        self.step_with_ready_grads()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the main params' grads and the model params' ``grad`` and ``main_grad``."""
        for leaf in self.leaf_optimizers:
            params = [p for group in leaf.param_groups for p in group["params"]]
            if not set_to_none and any(is_foreign_dtensor(p.grad) for p in params):
                # torch would call zero_() on the hyper DTensor grads, which hyper refuses outside
                # SkipDTensorDispatch: zero their local shards instead (same result, no dispatch).
                for p in params:
                    _clear_grads(p, set_to_none=False)
            else:
                leaf.zero_grad(set_to_none=set_to_none)
        for model_param, _ in self._low_precision_pairs():
            _clear_grads(model_param, set_to_none)
        for p in self._fp32_params():
            _clear_grads(p, set_to_none)

    @torch.no_grad()
    def _copy_pairs(self, *, to_model: bool) -> None:
        """Copy local shard to local shard between model and main params, in either direction."""
        pairs = list(self._low_precision_pairs())
        if pairs:
            models = local_tensors(m for m, _ in pairs)
            mains = local_tensors(f for _, f in pairs)
            torch._foreach_copy_(*((models, mains) if to_model else (mains, models)))

    def _copy_main_params_to_model_params(self) -> None:
        self._copy_pairs(to_model=True)

    def reload_model_params(self) -> None:
        """Refresh the fp32 main params from the model params (loses fp32 tails;
        docs/hyper_parallel.md#rfc-001-8-main_grad-and-step)."""
        self._copy_pairs(to_model=False)

    # ---- state dict --------------------------------------------------------------------------
    def main_params_by_fqn(self) -> dict[str, nn.Parameter]:
        """``{fqn: fp32 main param}`` for the low-precision params only."""
        return {self.fqn(model): main for model, main in self._low_precision_pairs()}

    def state_dict(self) -> dict:
        """Leaf-optimizer state keyed by model FQN plus the fp32 main params of bf16/fp16 params."""
        return run_state_dict_hooks(self, self._state_dict)

    def _state_dict(self) -> dict:
        sd = leaf_state_dict_by_fqn(self.leaf_optimizers, self.fqn)
        sd[MP_KEY] = {MAIN_PARAMS_KEY: self.main_params_by_fqn()}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict from :meth:`state_dict` or a plain FQN-keyed optimizer state dict.

        With every main param present they are restored exactly (no bf16 round trip, no
        :meth:`reload_model_params`). Without the ``_mixed_precision_optimizer`` section the main
        params are rebuilt from the model params, with a warning. A partial section raises
        before anything is loaded, listing every missing FQN.
        """
        run_load_state_dict_hooks(self, state_dict, self._load_state_dict)

    def _load_state_dict(self, state_dict: dict) -> None:
        saved_main = self.check_main_params_complete(state_dict)
        load_leaf_state_dicts(self.leaf_optimizers, state_dict, self.fqn)   # validates, then loads
        if saved_main is None:
            self.reload_model_params()
            if any(True for _ in self._low_precision_pairs()):
                warnings.warn(
                    "optimizer state has no _mixed_precision_optimizer.fp32_from_fp16_params: the fp32 "
                    "main params were rebuilt from the low-precision model params, so the fp32 tails "
                    "lost at the last cast cannot be recovered", UserWarning, stacklevel=4)
            return
        with torch.no_grad():
            for fqn, main in self.main_params_by_fqn().items():
                _copy_local(main, saved_main[fqn], fqn)

    def check_main_params_complete(self, state_dict: dict) -> dict | None:
        """The saved ``{fqn: main param}`` section, None when absent; raise if it is partial."""
        section = state_dict.get(MP_KEY)
        if section is None:
            return None
        saved = section.get(MAIN_PARAMS_KEY, {})
        missing = [fqn for fqn in self.main_params_by_fqn() if fqn not in saved]
        if missing:
            raise_partial_main_params(missing)
        return saved


def raise_partial_main_params(missing: Iterable[str]) -> None:
    missing = sorted(missing)
    raise ValueError(
        f"checkpoint is incomplete: {MP_KEY}.{MAIN_PARAMS_KEY} lacks the fp32 main params of "
        f"{len(missing)} parameter(s): {', '.join(missing)}. Refusing to load (nothing was "
        f"written) rather than silently rebuilding them from the low-precision model params.")


def _clear_grads(p: torch.Tensor, set_to_none: bool) -> None:
    for attr in ("grad", "main_grad"):
        value = getattr(p, attr, None)
        if value is None:
            continue
        if set_to_none:
            setattr(p, attr, None)
        else:
            with torch.no_grad():
                local_tensor(value).zero_()
    if hasattr(p, "grad_added_to_main_grad"):
        p.grad_added_to_main_grad = False


def _copy_local(dst: torch.Tensor, src: torch.Tensor, fqn: str) -> None:
    dst_local, src_local = local_tensor(dst), local_tensor(src)
    if dst_local is src_local:
        return
    if dst_local.shape != src_local.shape:
        raise ValueError(f"main param {fqn!r}: saved local shape {tuple(src_local.shape)} does not "
                         f"match {tuple(dst_local.shape)}; load sharded checkpoints through "
                         f"load_checkpoint (DCP reshards)")
    dst_local.copy_(src_local)


#: Megatron / hyper-parallel name of the same wrapper.
Float16OptimizerWithFloat16Params = MainParamsOptimizer
