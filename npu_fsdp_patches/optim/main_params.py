"""FP32 ``main_param`` wrapper for low-precision models (docs/design.md#43-hp_fp32_main_params,
docs/hyper_parallel.md#rfc-001-7-optimizers to #rfc-001-9-checkpoints).

A bf16/fp16 model loses small updates when the optimizer writes straight into low-precision
params. :class:`MainParamsOptimizer` gives every bf16/fp16 param its own fp32 ``main_param``,
swaps it into the leaf optimizers' param groups (existing state moves with it), and runs

    prepare_grads()          main_param.grad = p.main_grad (fp32) or p.grad.float(); p.grad = None
    step_with_ready_grads()  leaf optimizers step on the main params, then main -> model params

The update formulas of the leaf optimizers (AdamW, Muon, ...) are untouched: they simply see fp32
params. FP32 params are their own main param (``p.main_param is p``), with no copy. A model param written
between steps (``load_state_dict``, an in-place write, ``p.data = t``) is the truth at the next step: its main
param is re-derived from it (:mod:`._model_writes`). fp16 models train with torch's ``GradScaler``
(:mod:`._loss_scaling`). The contract with torch code: docs/main_params.md#contract-with-torch-code.

Params may be plain tensors, torch DTensors (``fully_shard``) or hyper-parallel DTensors. Copies
between model and main params go local shard to local shard, so no collective is added and
hyper DTensors (whose ops fail outside ``SkipDTensorDispatch``) are never dispatched on: only the
leaf optimizers' step needs that context (``with SkipDTensorDispatch(): opt.step()``, as hyper's
trainer runs it); construction, ``prepare_grads``, ``zero_grad`` and the state dict work outside.

To torch code the wrapper is an optimizer over the *model* params: ``param_groups`` list them,
``state`` is keyed by them, and a bf16/fp16 param's state also holds its fp32 main param as
``state[p]["main_param"]`` (Transformer Engine's ``FusedAdam`` keeps ``master_param`` the same
way). So torch's ``get_optimizer_state_dict``/``set_optimizer_state_dict`` and DCP save, load and
reshard it like any optimizer (docs/main_params.md). :mod:`.main_params_checkpoint` adds
checks on the checkpoint before loading.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
from torch import nn

from ._leaf_views import MAIN_PARAM, LeafDefaults, LeafParamGroups, LeafState, ModelParamGroup
from ._loss_scaling import found_inf, unscale_, widen_fp16_grads, widened
from ._main_param_tensors import clear_grads, fp32_grad, released_grads, zero_grad_like
from ._main_params_fused import compiled_adam_step, fusable_leaf
from ._main_params_build import (check_new_group, check_params, leaf_optimizers, main_params_for, record_wrap,
                                 reset_param_caches, swap_in_main_params)
from ._model_writes import ModelWrites, adopt_written, check_layouts, rederive_from_model
from ._main_params_state import (MAIN_PARAMS_KEY, MP_KEY, check_main_param, copy_into_main, fqn_layout,
                                 merge_rfc_section, native_state_dict, raise_partial_main_params, rfc_section,
                                 split_by_leaf, unflatten)
from ._optimizer_contract import (init_optimizer_contract, pause_global_step_hooks, resume_global_step_hooks,
                                  run_load_state_dict_hooks, run_state_dict_hooks, split_non_param_state)
from ._rollback import Rollback
from .tensors import is_foreign_dtensor, is_torch_dtensor, local_tensor, local_tensors

__all__ = ["MainParamsOptimizer", "Float16OptimizerWithFloat16Params", "leaf_optimizers",
           "MAIN_PARAM", "MP_KEY", "MAIN_PARAMS_KEY"]


class MainParamsOptimizer(torch.optim.Optimizer):
    """Megatron-style fp32 main-param composition over one or more leaf optimizers.

    Args:
        optimizer: a torch optimizer, a list or dict of them, or a chained optimizer exposing
            ``chained_optimizers``/``optimizers_dict``.
        model: the module owning the params; gives every param its FQN.

    ``param_groups``, ``state`` and ``defaults`` are views of the leaf optimizers shown with the
    model params (``param_groups[i]["params"]`` are model params, ``state`` is keyed by them, a
    bf16/fp16 param's state adds ``"main_param"``); the leaves themselves step on the main params.
    Writes reach the leaf that owns the param or group; new groups go to the leaf with their main
    params (:meth:`add_param_group`); writes that could not take effect (removing or replacing
    groups, defaults over several leaves, reassigning the attributes) are refused. So LR schedulers, grad clipping,
    ``zero_grad`` and torch's distributed state-dict API behave as on a plain optimizer, and step and
    state-dict hooks (instance and global) fire as on a plain optimizer: the contract, row by row, is
    docs/main_params.md#contract-with-torch-code. :meth:`step` fires the step hooks once (global hooks
    do not see the leaves' steps); the split Megatron calls (:meth:`prepare_grads`,
    :meth:`step_with_ready_grads`) do not, as on Megatron's own optimizer.

    An optimizer that already keeps fp32 masters of its own (another main-params wrapper,
    ``FusedAdam(master_weights=True)``, veomni's ``MasterFP32AdamW``) is refused with the reason,
    before anything is written.

    Writes to the model between steps are kept, ``zero_grad`` leaves the grads a plain optimizer
    leaves, and ``torch.amp.GradScaler`` drives it as torch documents.
    """

    def __init__(self, optimizer: Any, model: nn.Module) -> None:
        init_optimizer_contract(self)   # Optimizer.__init__ minus params: they live in the leaves
        self.optimizer = optimizer
        self.model = model
        self.leaf_optimizers = leaf_optimizers(optimizer)
        fqn_by_id = {}
        for name, p in model.named_parameters():
            fqn_by_id.setdefault(id(p), name)
        self.float16_groups: list[list[nn.Parameter]] = []
        self.fp32_from_float16_groups: list[list[nn.Parameter]] = []
        self.fp32_from_fp32_groups: list[list[nn.Parameter]] = []
        self._fqns: list[tuple[nn.Parameter, str]] = []   # (model param, FQN), in group order
        self._non_param_state: dict = {}   # opt.state keys that are no tensor (torch keeps them in state)
        check_params(self.leaf_optimizers, fqn_by_id)      # every check before the first write
        rollback = Rollback()
        record_wrap(rollback, optimizer, self.leaf_optimizers, model)
        try:
            for leaf in self.leaf_optimizers:
                for g, group in enumerate(leaf.param_groups):
                    float16, mains, fp32, fqns = swap_in_main_params(leaf, g, group, fqn_by_id)
                    self.float16_groups.append(float16)
                    self.fp32_from_float16_groups.append(mains)
                    self.fp32_from_fp32_groups.append(fp32)
                    self._fqns.extend(fqns)
            self._index_params()
            reset_param_caches(optimizer, self.leaf_optimizers,
                               {main: self.model_param(main) for main in self._main_params()},
                               {id(m): self.fqn(m) for m, _ in self._low_precision_pairs()})
            #: per bf16/fp16 param, the dtype of the grad the last step moved to its main param (None: it had
            #: none), so that ``zero_grad(set_to_none=False)`` gives back the zero grad a plain optimizer keeps
            self._released: list[torch.dtype | None] = [None] * len(self._low_precision_pairs())
            #: main params written by a load or a ``state[p]["main_param"]`` write since the last copy back:
            #: they hold values the model does not (yet); a compiled step cannot tell them from model writes
            self._main_ahead: frozenset[int] = frozenset()
            self._widen_fp16_grads()   # last: undoes itself if it fails midway
        except BaseException:
            rollback.restore()   # the optimizer and model as they were handed in
            raise

    def _index_params(self) -> None:
        """The id-keyed lookups and the state view, (re)built from the lists (after a copy, too)."""
        self._model_param_by_id: dict[int, nn.Parameter] = {}   # optimizer (main) param -> model param
        self._main_param_by_id: dict[int, nn.Parameter] = {}    # model param -> main param
        self._fqn_by_id: dict[int, str] = {}                    # model or main param -> FQN
        mains = {id(model): main for model, main in self._low_precision_pairs()}
        for model, fqn in self._fqns:
            main = mains.get(id(model), model)
            model.main_param = main
            self._model_param_by_id[id(main)] = model
            self._main_param_by_id[id(model)] = main
            self._fqn_by_id[id(model)] = self._fqn_by_id[id(main)] = fqn
        self._state_view = LeafState(self.leaf_optimizers, self._main_of_key, self.model_param,
                                     self._describe_non_optimizer_param, self._copy_into_main,
                                     self._non_param_state)
        self._derived_from_model = {id(main) for _, main in self._low_precision_pairs()}
        #: main param -> its global (shape, stride) as ints, for the fp32 grads a compiled step builds
        #: one torch Adam/AdamW leaf: a compiled step may run as one graph (_main_params_fused)
        self._fusable_leaf = (len(self.leaf_optimizers) == 1 and self.optimizer is self.leaf_optimizers[0]
                              and len(self.optimizer.param_groups) == len(self.float16_groups)   # no repeat
                              and fusable_leaf(self.optimizer))
        self._layouts = {id(main): (tuple(main.shape), tuple(main.stride()))
                         for main in self._main_params() if is_torch_dtensor(main)}
        #: the model params' fingerprints as the wrapper last wrote them (writes between steps, _model_writes);
        #: params added since keep the pending writes of the others (a copy builds its own)
        models = [model for model, _ in self._low_precision_pairs()]
        tracked = vars(self).get("_writes")
        self._writes = ModelWrites(models) if tracked is None else tracked.grown(models)

    # ---- iteration helpers -----------------------------------------------------------------------
    # Lists, not generators: the compiled step (prepare_grads, _copy_pairs, zero_grad) iterates them,
    # and torch 2.6's dynamo graph-breaks on a generator (``yield from zip(...)``: "SEND ZipVariable").
    def _low_precision_pairs(self) -> list[tuple[nn.Parameter, nn.Parameter]]:
        return [pair for model_group, main_group in zip(self.float16_groups, self.fp32_from_float16_groups)
                for pair in zip(model_group, main_group)]

    def _fp32_params(self) -> list[nn.Parameter]:
        return [p for group in self.fp32_from_fp32_groups for p in group]

    def _main_params(self) -> list[nn.Parameter]:
        return [p for leaf in self.leaf_optimizers for group in leaf.param_groups for p in group["params"]]

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
        return LeafParamGroups(self.leaf_optimizers, self.model_param, type(self).__name__, self._add_group)

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
    def defaults(self) -> LeafDefaults:
        return LeafDefaults(self.leaf_optimizers[0].defaults, type(self).__name__,
                            writable=len(self.leaf_optimizers) == 1)

    @defaults.setter
    def defaults(self, value: Any) -> None:
        self._refuse_assignment("defaults")

    def _refuse_assignment(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__}.{name} is a view of the wrapped optimizers and "
                             f"cannot be reassigned; change the leaf optimizers before wrapping them, "
                             f"or use load_state_dict()")

    def _main_of_key(self, param: Any) -> nn.Parameter | None:
        """The main param behind a ``state`` key: keys are model params (fp32 ones are their own)."""
        return self._main_param_by_id.get(id(param)) if isinstance(param, torch.Tensor) else None

    def _describe_non_optimizer_param(self, param: Any) -> str:
        if id(param) in self._model_param_by_id:
            return (f"the fp32 main param of {self.fqn(param)!r} (the optimizer state is keyed by the "
                    f"model param, as on a plain optimizer: optimizer.state[model_param]; the leaf "
                    f"optimizers key theirs by the main param)")
        return f"a {type(param).__name__} that is no param of the wrapped optimizers"

    def _copy_into_main(self, main: torch.Tensor, value: Any) -> None:
        records = self._writes.saved(), self._main_ahead
        self._mains_written([main])
        try:
            copy_into_main(main, value, self.fqn(main))
        except BaseException:
            self._writes.restore(records[0])
            vars(self)["_main_ahead"] = records[1]
            raise

    def __getstate__(self) -> dict:
        """Like torch's Optimizer: everything but the hooks (which may hold lambdas)."""
        state = {k: v for k, v in self.__dict__.items()
                 if not k.startswith("_optimizer_")
                 and k not in ("_state_view", "_derived_from_model", "_main_ahead", "_writes", "_widened",
                               "_widen_handles")
                 and not k.endswith("_by_id")}
        pairs = self._low_precision_pairs()
        state["_derived"] = [id(main) in self._derived_from_model for _, main in pairs]
        state["_ahead"] = [id(main) in self._main_ahead for _, main in pairs]
        return state

    def __setstate__(self, state: dict) -> None:
        derived, ahead = state.pop("_derived"), state.pop("_ahead", None)
        state.setdefault("_non_param_state", {})
        self.__dict__.update(state)
        init_optimizer_contract(self)
        self._index_params()   # id-keyed lookups hold ids of the original's params
        pairs = self._low_precision_pairs()
        self._derived_from_model = {id(main) for (_, main), d in zip(pairs, derived) if d}
        self._main_ahead = frozenset(id(main) for (_, main), a in zip(pairs, ahead or []) if a)
        self._widen_fp16_grads()   # a copy's params carry neither the hooks nor grad_dtype

    def __repr__(self) -> str:
        leaves = "\n".join(repr(leaf) for leaf in self.leaf_optimizers)
        count = sum(len(group) for group in self.float16_groups)
        return f"{type(self).__name__} with fp32 main params of {count} bf16/fp16 param(s) over (\n{leaves}\n)"

    def add_param_group(self, param_group: dict) -> None:
        """As torch's ``Optimizer.add_param_group``, for model params: bf16/fp16 ones get new fp32 main
        params (from their current values), and the group goes to the leaf optimizer, which fills in its
        defaults and checks it. A wrapper over several leaf optimizers cannot tell which leaf is meant:
        add the group to that leaf before wrapping. Every check runs before the first write; a failure
        after it (the leaf's own ``add_param_group``) is rolled back."""
        params, fqn_by_id = check_new_group(self.leaf_optimizers, param_group, self.model,
                                            {id(model) for model, _ in self._fqns}, type(self).__name__)
        named = bool(params) and all(isinstance(x, tuple) for x in params)
        tensors = [x[1] if named else x for x in params]
        leaf = self.leaf_optimizers[0]
        rollback = Rollback()
        record_wrap(rollback, self.optimizer, self.leaf_optimizers, self.model)
        rollback.attrs(self)
        try:
            stepped, float16, mains, fp32, fqns = main_params_for(tensors, fqn_by_id)
            leaf_params = [(x[0], main) for x, main in zip(params, stepped)] if named else stepped
            leaf.add_param_group({**param_group, "params": leaf_params})
            self.float16_groups = [*self.float16_groups, float16]
            self.fp32_from_float16_groups = [*self.fp32_from_float16_groups, mains]
            self.fp32_from_fp32_groups = [*self.fp32_from_fp32_groups, fp32]
            self._fqns = [*self._fqns, *fqns]
            derived = self._derived_from_model | {id(main) for main in mains}
            self._index_params()
            self._derived_from_model = derived   # new main params are as derived from the model
            self._released = [*self._released, *[None] * len(mains)]
            reset_param_caches(self.optimizer, self.leaf_optimizers,
                               {main: self.model_param(main) for main in self._main_params()}, {})
            self._widened = self._widened | {id(p) for p in widened(float16)}
            widen_fp16_grads(self, float16, self._widen_handles)   # last: undoes itself if it fails midway
        except BaseException:
            rollback.restore()
            raise

    def _add_group(self, group: Any) -> None:
        """``param_groups.append(group)``: a group of the view is repeated in its leaf (as torch's
        ``param_groups.extend(param_groups)`` repeats the same dict); any other goes to
        :meth:`add_param_group` (which, unlike a plain append, fills in the defaults)."""
        if isinstance(group, ModelParamGroup):
            leaf_group = group.leaf_group()
            owner = next((leaf for leaf in self.leaf_optimizers
                          if any(g is leaf_group for g in leaf.param_groups)), None)
            if owner is not None:
                owner.param_groups.append(leaf_group)
                self._index_params()
                return
            group = dict(group)
        self.add_param_group(group)

    #: ``GradScaler.step`` hands this optimizer the scale and the inf/NaN flag and calls its step, which skips on
    #: inf/NaN and unscales the fp32 main grads itself (:mod:`._loss_scaling`), as torch's fused Adam does
    _step_supports_amp_scaling = True

    def _widen_fp16_grads(self) -> None:
        """fp16 model params accumulate fp32 grads (torch >= 2.10), which ``GradScaler.unscale_`` accepts.
        The wrapper's attributes are set first: nothing can fail after the params were changed."""
        models = [model for model, _ in self._low_precision_pairs()]
        self._widened: set[int] = {id(p) for p in widened(models)}
        self._widen_handles: list = []
        widen_fp16_grads(self, models, self._widen_handles)

    # ---- step lifecycle --------------------------------------------------------------------
    @torch.no_grad()
    def prepare_grads(self) -> None:
        """Hand each main param its fp32 grad: ``main_grad`` first, else ``grad.float()``."""
        # under torch.compile a traced DTensor's stride() is symbolic: give from_local the ints cached here
        layouts = self._layouts if torch.compiler.is_compiling() else {}
        pairs = self._low_precision_pairs()
        self._released[:] = released_grads(pairs)   # in place: torch 2.6's dynamo cannot set an optimizer's attribute
        for model_param, main_param in pairs:
            grad = getattr(model_param, "main_grad", None)
            if grad is None:
                grad = model_param.grad
            main_param.grad = (None if grad is None
                               else fp32_grad(grad, main_param, layouts.get(id(main_param))))
            model_param.grad = None
        for p in self._fp32_params():
            main_grad = getattr(p, "main_grad", None)
            if main_grad is not None:
                p.grad = fp32_grad(main_grad, p, layouts.get(id(p)))

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        """Step the leaf optimizers on the main params, then copy main -> model params.

        Main params are first brought up to date with the model: model params written since the
        wrapper last wrote them are the truth (:meth:`_adopt_model_writes`), and main params still as
        derived from the model (never trained or loaded) take its current values (torch's priming
        step would otherwise copy stale values over a model loaded after wrapping)."""
        eager = not torch.compiler.is_compiling()   # read here: after the leaves' graph break it misleads dynamo
        self._before_update()
        self._step_leaves(eager)
        return True

    def _before_update(self) -> None:
        """Before the leaves step (eager and compiled): model writes adopted, derived main params refreshed."""
        self._adopt_model_writes()
        self._refresh_derived_main_params()

    def _step_leaves(self, eager: bool) -> None:
        paused = pause_global_step_hooks()   # one step to torch code: global hooks fire for the wrapper only
        try:
            if isinstance(self.optimizer, (list, tuple, dict)):
                for leaf in self.leaf_optimizers:
                    leaf.step()
            else:
                self.optimizer.step()   # a chained optimizer keeps its own step order
        finally:
            resume_global_step_hooks(paused)
        self._finish_step(self.param_groups, eager)

    def _adopt_model_writes(self) -> None:
        """Model params written since the wrapper last wrote them are the truth: their main params are
        re-derived from them element by element (:mod:`._model_writes`). Eager steps compare only params
        whose fingerprint moved; inside a compiled graph, where versions cannot be read, every param is
        compared by value, except right after a load or main-param write (main params then hold values the
        model does not, so that one step takes the eager route, through a graph break)."""
        if torch.compiler.is_compiling():
            if self._main_ahead:
                _adopt_outside_graph(self)
                return
            pairs = self._low_precision_pairs()   # derived ones too: one graph for every step
            check_layouts(pairs, self.fqn)
            for model, main in pairs:
                rederive_from_model(local_tensor(main), local_tensor(model))
            return
        pairs = self._low_precision_pairs()
        models = [model for model, _ in pairs]
        moved = self._writes.moved(models)
        if moved:
            adopt_written([pairs[i] for i in moved], self.fqn)
            self._writes.record(models, moved)

    def _mains_written(self, mains: list[torch.Tensor], ahead: bool = True) -> None:
        """Main params just written by a load or a ``state[p]["main_param"]`` write: they win over model
        writes made before (the later write wins), and keep their values until the next copy back
        (``ahead``; else they were rebuilt from the model and equal it)."""
        index = {id(main): i for i, (_, main) in enumerate(self._low_precision_pairs())}
        written = [index[id(main)] for main in mains if id(main) in index]
        if written:
            self._writes.record([model for model, _ in self._low_precision_pairs()], written)
            if ahead:
                self._main_ahead = self._main_ahead | {id(main) for main in mains if id(main) in index}

    def _refresh_derived_main_params(self) -> None:
        """Before a step: main params still as derived from the model take the model's current values."""
        if self._derived_from_model:
            self._copy_pairs(to_model=False, pairs=[(m, f) for m, f in self._low_precision_pairs()
                                                     if id(f) in self._derived_from_model])

    def _finish_step(self, groups: list, eager: bool) -> None:
        """After a step: the main params count as trained once a step ran at a nonzero lr (torch's priming
        step runs at lr=0), then main -> model params, whose fingerprints are taken when ``eager`` (a compiled
        graph cannot read them; the next eager step compares by value once). ``eager`` comes from the caller:
        ``torch.compiler.is_compiling()`` read here, after the leaves' graph break, makes dynamo drop this
        method's attribute writes (torch 2.13). The lr is read only while some main param is still derived: a
        tensor lr's value is data, on which dynamo would graph-break in every compiled step."""
        if self._derived_from_model and any(_nonzero(group.get("lr", 1.0)) for group in groups):
            self._derived_from_model = set()
        self._copy_main_params_to_model_params()
        if self._main_ahead:
            _forget_main_ahead(self)
        if eager:
            self._writes.record_versions([model for model, _ in self._low_precision_pairs()])

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """``prepare_grads`` then ``step_with_ready_grads``. Compiled over one torch Adam/AdamW whose state
        exists, the same step traced as one graph (:mod:`._main_params_fused`), which never stores the fp32
        cast of a bf16 grad: ``main_param.grad`` is then ``None`` after the step. Called by
        ``GradScaler.step`` (``_step_supports_amp_scaling``): nothing is written when it found an inf/NaN grad,
        and the fp32 main grads are unscaled after the cast when it hands a scale (:mod:`._loss_scaling`)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if found_inf(self):   # GradScaler.step found an inf/NaN grad: nothing is written, as torch skips the step
            return loss
        if compiled_adam_step(self):   # compiled over a torch Adam/AdamW: one graph
            return loss
        eager = not torch.compiler.is_compiling()   # read before the leaves' graph break (see _finish_step)
        self._before_update()   # first: a refused model write leaves the grads where they were; compiled, the
        self.prepare_grads()    # by-value adoption shares the grads' graph (alone it cost a graph and a pass)
        self._unscale_main_grads()
        self._step_leaves(eager)
        return loss

    def _unscale_main_grads(self) -> None:
        """``GradScaler.step`` without ``unscale_`` before it hands the scale: unscale the fp32 grads now."""
        scale = getattr(self, "grad_scale", None)
        if scale is not None:
            unscale_([p.grad for p in self._main_params() if p.grad is not None], scale)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's ``zero_grad`` on the model params, whose grads a step moved to the main params: with
        ``set_to_none=False`` every model param that had a grad at the step gets a zero grad back (of that
        grad's dtype), as a plain optimizer leaves one. The fp32 main params of bf16/fp16 params never keep a
        grad (the next step makes it again), and ``main_grad`` attributes are cleared as ``grad``."""
        pairs = self._low_precision_pairs()
        for _, main in pairs:
            main.grad = None
        for leaf in self.leaf_optimizers:
            params = [p for group in leaf.param_groups for p in group["params"]]
            if not set_to_none and any(is_foreign_dtensor(p.grad) for p in params):
                # torch would call zero_() on the hyper DTensor grads, which hyper refuses outside
                # SkipDTensorDispatch: zero their local shards instead (same result, no dispatch).
                for p in params:
                    clear_grads(p, set_to_none=False)
            else:
                leaf.zero_grad(set_to_none=set_to_none)
        released = list(self._released)
        self._released[:] = [None] * len(pairs)
        for (model_param, _), dtype in zip(pairs, released):
            clear_grads(model_param, set_to_none)
            if not set_to_none and model_param.grad is None and dtype is not None:
                model_param.grad = zero_grad_like(model_param, dtype)
        for p in self._fp32_params():
            clear_grads(p, set_to_none)

    @torch.no_grad()
    def _copy_pairs(self, *, to_model: bool, pairs: list | None = None) -> None:
        """Copy local shard to local shard between model and main params, in either direction."""
        pairs = list(self._low_precision_pairs()) if pairs is None else pairs
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
        self._derived_from_model = {id(main) for _, main in self._low_precision_pairs()}
        self._main_ahead = frozenset()
        self._writes.record([model for model, _ in self._low_precision_pairs()])

    # ---- state dict --------------------------------------------------------------------------
    def main_params_by_fqn(self) -> dict[str, nn.Parameter]:
        """``{fqn: fp32 main param}`` for the low-precision params only."""
        return {self.fqn(model): main for model, main in self._low_precision_pairs()}

    def state_dict(self) -> dict:
        """torch's layout over the model params; a bf16/fp16 param's state adds ``"main_param"``,
        and ``_mixed_precision_optimizer.fp32_from_fp16_params`` maps every bf16/fp16 param's FQN to
        the same main param (hyper-parallel's RFC layout; ``{}`` for an fp32 model). Over
        hyper-parallel DTensors it is upstream's own layout: keyed by FQN (flattened over several
        leaf optimizers, as hyper's ``ChainedOptimizer`` does), the section the main params' only
        copy (docs/main_params.md §2.1)."""
        return run_state_dict_hooks(self, self._state_dict)

    def _state_dict(self) -> dict:
        self._adopt_model_writes()   # the main params as the next step would use them
        if not any(is_foreign_dtensor(p) for p in self._main_params()):
            state_dict = native_state_dict(self.leaf_optimizers, self.model_param)
        else:   # never reaches torch's API (docs/main_params.md §2.1): upstream's own layout
            groups = self._group_fqns()
            flatten = getattr(self.optimizer, "flatten", len(self.leaf_optimizers) > 1)
            native = native_state_dict(self.leaf_optimizers, self.model_param, with_main_param=False)
            state_dict = fqn_layout(native, [f for g in groups for f in g], bool(flatten))
        state_dict[MP_KEY] = rfc_section(self.main_params_by_fqn())
        return self._with_non_param_state(state_dict)

    def _with_non_param_state(self, state_dict: dict) -> dict:
        """``state_dict`` with the ``state`` keys that are no param, as torch packs them (key and value as
        they are); the flattened layout (hyper-parallel's, several leaves) has no place for them: warned."""
        if self._non_param_state:
            if "state" in state_dict:
                state_dict["state"].update(self._non_param_state)
            else:
                warnings.warn(f"{type(self).__name__}.state_dict: the flattened layout has no place for the "
                              f"optimizer state keys that are no param ({sorted(map(repr, self._non_param_state))}"
                              f"); they are not saved", UserWarning, stacklevel=4)
        return state_dict

    def _group_fqns(self) -> list[list[str]]:
        return [[self.fqn(main) for main in group["params"]]
                for leaf in self.leaf_optimizers for group in leaf.param_groups]

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict of this wrapper, of a plain optimizer over the same model params, or
        of hyper-parallel's ``Float16OptimizerWithFloat16Params`` (FQN layout, nested or flattened as
        its ``ChainedOptimizer(flatten=True)`` saves, with a ``_mixed_precision_optimizer`` section;
        also our earlier layout).

        Saved main params are restored exactly (docs/main_params.md). A state without them (a
        plain optimizer's) rebuilds the main params from the model params, with a warning; one
        that has them for some bf16/fp16 params only raises before anything is loaded.
        """
        run_load_state_dict_hooks(self, state_dict, self._load_state_dict)

    def _load_state_dict(self, state_dict: dict) -> None:
        owner = type(self).__name__
        groups = self._group_fqns()
        current = [g for leaf in self.leaf_optimizers for g in leaf.param_groups]
        state_dict, non_param_state = split_non_param_state(unflatten(state_dict, groups, current),
                                                            {f for g in groups for f in g})
        merged, names = merge_rfc_section(state_dict, [f for g in groups for f in g],
                                          self.main_params_by_fqn(), owner)
        natives, saved, fp32_saved = split_by_leaf(self.leaf_optimizers, merged, self.model_param, owner,
                                                   self.fqn, names)
        missing = [self.fqn(model) for model, main in saved.items() if main is None]
        if missing and len(missing) < len(saved):
            raise_partial_main_params(missing)
        rebuild, not_loaded, load = [], [], []
        for model, main in self._low_precision_pairs():   # every check before the first write
            value = saved.get(model)
            if value is None or self._is_stale(main, value, model):
                rebuild.append((model, main))
                if model in saved:
                    not_loaded.append(self.fqn(model))
            else:
                check_main_param(main, value, self.fqn(model))
                load.append((model, main, value))
        for p, value in fp32_saved.items():   # a low-precision run's fp32 master: resume from it
            check_main_param(p, value, self.fqn(p))
            if local_tensor(value) is not local_tensor(p):
                load.append((p, p, value))
        rollback = Rollback()   # what can still fail midway (torch's load, a copy) is undone
        for leaf in self.leaf_optimizers:
            rollback.optimizer(leaf)
        for model, main, value in load:
            if local_tensor(value) is not local_tensor(main):
                rollback.tensor(main)
        for _, main in rebuild:
            rollback.tensor(main)
        rollback.dict(self._non_param_state)
        derived = self._derived_from_model   # replaced below, never mutated: restored as is
        records = self._writes.saved(), self._main_ahead
        try:
            for leaf, native in zip(self.leaf_optimizers, natives):
                leaf.load_state_dict(native)
            for model, main, value in load:
                copy_into_main(main, value, self.fqn(model))
            self._copy_pairs(to_model=False, pairs=rebuild)
            self._non_param_state.clear()   # replaced by the loaded ones, as torch replaces its state
            self._non_param_state.update(non_param_state)
            self._derived_from_model = (derived - {id(main) for _, main, _ in load}) | {id(m) for _, m in rebuild}
            self._mains_written([main for _, main, value in load if local_tensor(value) is not local_tensor(main)])
            self._mains_written([main for _, main in rebuild], ahead=False)   # equal to the model now
        except BaseException:
            rollback.restore()
            vars(self)["_derived_from_model"] = derived
            self._writes.restore(records[0])
            vars(self)["_main_ahead"] = records[1]
            raise
        if not_loaded:
            warnings.warn(
                f"{type(self).__name__}.load_state_dict: the optimizer state has no fp32 main params "
                f"for {', '.join(not_loaded)} (a plain optimizer's checkpoint?): they were rebuilt "
                f"from the low-precision model params, so the fp32 tails lost at the last cast "
                f"cannot be recovered", UserWarning, stacklevel=4)

    def _is_stale(self, main: nn.Parameter, value: Any, model: nn.Parameter) -> bool:
        """``value`` is the live main param, still as derived from the model (never trained or
        loaded), and the model param no longer rounds from it: a load left the main param out (DCP
        with ``allow_partial_load`` and a plain optimizer's checkpoint, into a fresh optimizer) while
        loading the model, so it must come from the model. A main param that holds trained or
        loaded values is kept: no comparison, so state-dict round trips cost no pass over the data."""
        if not isinstance(value, torch.Tensor) or local_tensor(value) is not local_tensor(main):
            return False
        if id(main) not in self._derived_from_model:
            return False
        model_local = local_tensor(model)
        return not torch.equal(local_tensor(main).to(model_local.dtype), model_local)


@torch._disable_dynamo
def _adopt_outside_graph(opt: MainParamsOptimizer) -> None:
    """:meth:`MainParamsOptimizer._adopt_model_writes` as an eager step runs it, from a compiled step."""
    opt._adopt_model_writes()


@torch._disable_dynamo
def _forget_main_ahead(opt: MainParamsOptimizer) -> None:
    """After the copy back, outside a compiled graph: torch 2.9's dynamo cannot set an optimizer's attribute
    ("Attempted setattr on a user-defined object"); only the step after a load or a main-param write, which
    already leaves the graph to adopt model writes, comes here."""
    opt._main_ahead = frozenset()


def _nonzero(lr: Any) -> bool:
    return bool(lr != 0) if not torch.is_tensor(lr) else bool((lr != 0).any())


#: Megatron / hyper-parallel name of the same wrapper.
Float16OptimizerWithFloat16Params = MainParamsOptimizer
