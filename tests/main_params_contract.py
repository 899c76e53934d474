"""torch's optimizer contract, run on a plain optimizer and on MainParamsOptimizer (issue 42).

Each case is the project's own version of one family of torch's optimizer contract tests
(pytorch/pytorch ``test/test_optim.py`` ``TestOptimRenewed``, named in the case's ``torch_test``),
written against a :class:`Run`, one side of a comparison. Per config (optimizer kind x model dtype)
every case runs twice, plain and wrapped, and the two observations must be equal, tensors bit for bit.
An exception is an observation too (its type), so where the plain optimizer fails the wrapper must
fail the same way. The wrapped model owns exactly the params the case makes.

The plain side of a bf16/fp16 config is the plain optimizer over fp32 params that hold the model's
values: what the wrapper's fp32 main params must hold. It sees the params as the model does
(:meth:`Run.view`: rounded to the model dtype, then fp32) and takes grads rounded to the model dtype,
so both sides step the same fp32 numbers. (A plain optimizer stepping the bf16 params themselves loses
small updates, which is what the wrapper is for: docs/main_params.md#contract-with-torch-code, row
"numerics".) The wrapped side also checks, after each step, that every model param is its main param
rounded (:meth:`Run.check`).

Where the wrapper differs by design (``state[p]["main_param"]``, the ``_mixed_precision_optimizer``
section, ``repr``, the profiler's nested step), the observation leaves it out and the table row says why.
Cases marked ``ranks`` also run on 2 gloo ranks over ``fully_shard`` (tests/multirank/
main_params_contract_cases.py): their params come from :meth:`Run.params` and their grads are set by hand.
"""
from __future__ import annotations

import copy
import functools
import io
import pickle
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.optim.lr_scheduler import ExponentialLR, LinearLR, ReduceLROnPlateau, StepLR
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from npu_fsdp_patches.optim import MainParamsOptimizer
from tests.support import bit_mismatches

LOW = (torch.bfloat16, torch.float16)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: the configs' optimizer kinds: class name in torch.optim, option sets (from torch's optim_inputs_func_*,
#: CPU ones, merged to three to keep the run lean; a tensor lr is its own case), the flags older state
#: dicts lack (OptimizerInfo.not_og_supported_flags), the implementations besides the forloop
KINDS = {
    "adamw": ("AdamW", [{}, {"lr": 0.01, "weight_decay": 0.1, "maximize": True}, {"weight_decay": 0.1, "amsgrad": True}],
              ("foreach", "differentiable", "fused", "maximize", "capturable"), ("foreach", "fused")),
    "adam": ("Adam", [{}, {"lr": 0.01, "weight_decay": 0.1, "maximize": True}, {"weight_decay": 0.1, "amsgrad": True}],
             ("foreach", "differentiable", "fused", "maximize", "capturable"), ("foreach", "fused")),
    "muon": ("Muon", [{}, {"lr": 0.01, "weight_decay": 0.2}, {"momentum": 0.8, "nesterov": False}], (), ()),
}
MAIN_PARAM, SECTION = "main_param", "_mixed_precision_optimizer"


def available(kind: str) -> bool:
    return hasattr(torch.optim, KINDS[kind][0])


# ---- one side of a comparison ------------------------------------------------------------------
class Holder(nn.Module):
    """The model of a wrapped case: owns exactly the params handed in (and ``modules``)."""

    def __init__(self, params: list, modules: dict | None = None) -> None:
        super().__init__()
        for name, module in (modules or {}).items():
            self.add_module(name, module)
        owned = {id(p) for p in self.parameters()}
        for p in params:
            if id(p) not in owned:
                self.register_parameter(f"p{len(owned)}", p)
                owned.add(id(p))


class Run:
    """One side of a comparison: ``kind`` of optimizer, model ``dtype``, ``wrapped`` or plain. ``mesh``:
    params are made sharded (``fully_shard`` over a holder module: tests/multirank)."""

    def __init__(self, kind: str, dtype: torch.dtype, wrapped: bool, mesh: Any = None) -> None:
        self.kind, self.dtype, self.wrapped, self.mesh = kind, dtype, wrapped, mesh
        self.cls = getattr(torch.optim, KINDS[kind][0])
        self.options, self.old_flags, self.impls = KINDS[kind][1:]
        self.matrices_only = kind == "muon"
        self._rounded: set[int] = set()   # plain side of bf16/fp16: fp32 params that stand for model params
        self._holder: dict[int, nn.Module] = {}
        self.optimizers: list = []

    @property
    def reference(self) -> bool:
        """The plain side of a bf16/fp16 config (fp32 params holding the model's values)."""
        return not self.wrapped and self.dtype in LOW

    # -- params
    def shape(self, *shape: int) -> tuple:
        """``shape``, made 2-D for Muon (which steps matrices only): a vector becomes a column."""
        return (*shape, 1) if self.matrices_only and len(shape) == 1 else shape

    def param(self, value: torch.Tensor, dtype: torch.dtype | None = None, noncontiguous: bool = False) -> nn.Parameter:
        """A param holding ``value`` rounded to the model dtype (``dtype``: a fixed dtype both sides use)."""
        model_dtype = dtype or self.dtype
        stored = torch.float32 if self.reference and dtype is None else model_dtype
        value = value.to(model_dtype).to(stored)
        if noncontiguous:   # a strided view with gaps, as torch's test_forloop_goes_right_direction makes
            base = torch.zeros(*value.shape, 2, dtype=stored)
            base[..., 0] = value
            value = base[..., 0]
        p = nn.Parameter(value)
        if self.reference and dtype is None:
            self._rounded.add(id(p))
        return p

    def params(self, *shapes: tuple, seed: int = 0, dtype: torch.dtype | None = None) -> list[nn.Parameter]:
        gen = torch.Generator().manual_seed(seed)
        values = [torch.randn(self.shape(*s), generator=gen) for s in shapes]
        if self.mesh is None:
            return [self.param(v, dtype) for v in values]
        from torch.distributed.fsdp import fully_shard
        holder = Holder([self.param(v, dtype) for v in values])
        fully_shard(holder, mesh=self.mesh)
        sharded = list(holder.parameters())
        for p, full in zip(sharded, values):
            self._holder[id(p)] = holder
            if self.reference and dtype is None:
                self._rounded.add(id(p))
        return sharded

    def model(self, model: nn.Module) -> nn.Module:
        """``model`` with its params rounded to the model dtype (fp32 on the plain side of bf16/fp16)."""
        with torch.no_grad():
            for p in model.parameters():
                p.data = p.data.to(self.dtype).to(torch.float32 if self.reference else self.dtype)
                if self.reference:
                    self._rounded.add(id(p))
        return model

    def same_role(self, copies: list, originals: list) -> None:
        """``copies`` (of a deepcopy or pickle) stand for the model params ``originals`` stand for."""
        self._rounded.update(id(c) for c, o in zip(copies, originals) if id(o) in self._rounded)

    def view(self, p: torch.Tensor) -> torch.Tensor:
        """``p`` as the model computes with it, in fp32 (differentiable)."""
        if id(p) in self._rounded:
            return p.to(self.dtype).float()
        return p.float() if p.dtype in LOW else p

    def forward(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``model(x)`` computed on :meth:`view` of its params, in fp32."""
        return torch.func.functional_call(model, {n: self.view(p) for n, p in model.named_parameters()},
                                          (x.to(torch.float32 if not x.is_complex() else x.dtype),))

    def grad(self, p: torch.Tensor, value: torch.Tensor) -> None:
        """Set ``p.grad`` by hand to ``value`` rounded to the model dtype (a DTensor like ``p``)."""
        dtype = self.dtype if id(p) in self._rounded else p.dtype
        value = value.to(dtype).to(p.dtype)
        if self.mesh is not None:
            from torch.distributed.tensor import distribute_tensor
            value = distribute_tensor(value, p.device_mesh, p.placements)
        p.grad = value

    def grads(self, params: list, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for p in params:
            self.grad(p, torch.randn(p.shape, generator=gen, dtype=torch.float32 if not p.is_complex() else p.dtype))

    # -- optimizers
    def optimizer(self, params: Any, model: nn.Module | None = None, cls: type | None = None, **kw) -> Any:
        """``cls`` (the run's kind) over ``params``; wrapped, in a MainParamsOptimizer over ``model`` (or a
        holder of exactly the params)."""
        params = list(params)
        leaf = (cls or self.cls)(params, **kw)
        if not self.wrapped:
            return leaf
        if model is None:
            flat = [p for x in params for p in (x["params"] if isinstance(x, dict) else [x])]
            flat = [p[1] if isinstance(p, tuple) else p for p in flat]
            holders = {id(self._holder[id(p)]) for p in flat if id(p) in self._holder}
            model = self._holder[id(flat[0])] if holders else Holder(flat)
        opt = MainParamsOptimizer(leaf, model)
        self.optimizers.append(opt)
        return opt

    def truth(self, opt: Any, p: torch.Tensor) -> torch.Tensor:
        """What must be equal across sides: the fp32 main param wrapped, the param itself plain."""
        return opt.main_param(p) if self.wrapped else p

    def truths(self, opt: Any, params: list) -> list:
        return [self.truth(opt, p).detach().clone() for p in params]

    def check(self) -> None:
        """Wrapped: every model param is its main param rounded, bit for bit (the main param of the
        wrapper built last over it: a case may build a second one over the same model)."""
        for opt in self.optimizers:
            for model, main in opt._low_precision_pairs():
                if model.main_param is not main:
                    continue
                count, first = bit_mismatches(model, main.detach().to(model.dtype))
                assert count == 0, f"{opt.fqn(model)} is not its main param rounded: {first}"

    def state(self, opt: Any, p: torch.Tensor) -> dict:
        """``opt.state[p]`` without ``main_param`` (the wrapper's by design), tensors cloned."""
        return {k: (v.detach().clone() if torch.is_tensor(v) else v)
                for k, v in opt.state[p].items() if k != MAIN_PARAM}

    def state_dict(self, opt: Any) -> dict:
        """``opt.state_dict()`` without what the wrapper adds by design (``main_param``, the section)."""
        sd = opt.state_dict()
        return {**{k: v for k, v in sd.items() if k != SECTION},
                "state": {k: ({n: t for n, t in e.items() if n != MAIN_PARAM} if isinstance(e, dict) else e)
                          for k, e in sd.get("state", {}).items()}}


# ---- comparing ---------------------------------------------------------------------------------
def differences(plain: Any, wrapped: Any, path: str = "") -> list[str]:
    """Where two observations differ: tensors bit for bit (values, dtype, shape), the rest by ``==``."""
    if torch.is_tensor(plain) or torch.is_tensor(wrapped):
        if not (torch.is_tensor(plain) and torch.is_tensor(wrapped)):
            return [f"{path}: {type(plain).__name__} vs {type(wrapped).__name__}"]
        count, first = bit_mismatches(plain, wrapped)
        return [f"{path}: {count} element(s) differ, {first}"] if count else []
    if isinstance(plain, dict) and isinstance(wrapped, dict):
        if list(plain) != list(wrapped):
            return [f"{path}: keys {list(plain)} vs {list(wrapped)}"]
        return [d for k in plain for d in differences(plain[k], wrapped[k], f"{path}[{k!r}]")]
    if isinstance(plain, (list, tuple)) and isinstance(wrapped, (list, tuple)):
        if len(plain) != len(wrapped):
            return [f"{path}: {len(plain)} vs {len(wrapped)} items"]
        return [d for i, (a, b) in enumerate(zip(plain, wrapped)) for d in differences(a, b, f"{path}[{i}]")]
    return [] if plain == wrapped else [f"{path}: {plain!r} vs {wrapped!r}"]


def equal(a: Any, b: Any) -> bool:
    """Like torch's assertEqual on state dicts: tensors by value (NaN-safe), the rest by ``==``."""
    return not differences(a, b)


def outcome(case: "Case", run: Run) -> tuple:
    """``("ok", observation)`` or ``("raises", exception type name)``; the wrapped side's rounding checked."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            observed = case.run(run)
        run.check()
        return "ok", observed
    except AssertionError:
        raise
    except Exception as exc:   # noqa: BLE001 - a failure is an observation: the other side must match it
        return "raises", type(exc).__name__


@dataclass
class Case:
    name: str
    run: Callable[[Run], Any]
    torch_test: str          # the TestOptimRenewed family it stands for
    ranks: bool = False      # also on 2 ranks over fully_shard (params from Run.params, grads by hand)


CASES: dict[str, Case] = {}


def case(torch_test: str, ranks: bool = False, variants: dict | None = None) -> Callable:
    """Register ``fn(run, **variant)`` as one case per variant (``name[variant]``)."""
    def register(fn: Callable) -> Callable:
        for suffix, kwargs in (variants or {"": {}}).items():
            name = fn.__name__ + (f"[{suffix}]" if suffix else "")
            CASES[name] = Case(name, functools.partial(fn, **kwargs), torch_test, ranks)
        return fn
    return register


def _weight_bias(run: Run, seed: int = 0, dtype: torch.dtype | None = None, noncontiguous: bool = False):
    gen = torch.Generator().manual_seed(seed)
    w = run.param(torch.randn(run.shape(10, 5), generator=gen), dtype, noncontiguous)
    b = run.param(torch.randn(run.shape(10), generator=gen), dtype, noncontiguous)
    return w, b, torch.randn(5, generator=gen)


def _loss(run: Run, w, b, x) -> torch.Tensor:
    return (run.view(w).mv(x) + run.view(b).reshape(-1)).pow(2).sum()


def _closure(run: Run, opt, w, b, x) -> Callable:
    def closure():
        opt.zero_grad()
        loss = _loss(run, w, b, x)
        loss.backward()
        return loss
    return closure


# ---- the cases: update numerics --------------------------------------------------------------------
_SCHEDULERS = {"none": [], "step": [lambda o: StepLR(o, gamma=0.9, step_size=10)],
               "linear+exp": [lambda o: LinearLR(o, start_factor=0.4, total_iters=4),
                              lambda o: ExponentialLR(o, gamma=0.9)],
               "plateau": [lambda o: ReduceLROnPlateau(o)]}


@case("test_forloop_goes_right_direction", variants={
    f"{layout},{sched}": {"noncontiguous": layout == "noncontiguous", "schedulers": sched}
    for layout, sched in (("contiguous", "none"), ("contiguous", "plateau"), ("noncontiguous", "step"),
                          ("noncontiguous", "linear+exp"))})
def goes_right_direction(run: Run, noncontiguous: bool, schedulers: str) -> dict:
    out = {}
    for i, options in enumerate(run.options):
        kw = dict(options, **({"foreach": False} if "foreach" in run.impls else {}))
        w, b, x = _weight_bias(run, noncontiguous=noncontiguous)
        opt = run.optimizer([w, b], **kw)
        scheds = [make(opt) for make in _SCHEDULERS[schedulers]]
        closure = _closure(run, opt, w, b, x)
        initial = closure().item()
        for _ in range(10):
            loss = closure()
            opt.step()
            for s in scheds:
                s.step(loss) if isinstance(s, ReduceLROnPlateau) else s.step()
        final = closure().item()
        out[i] = {"right_way": final > initial if kw.get("maximize") else final < initial,
                  "truths": run.truths(opt, [w, b]), "lr": [g["lr"] for g in opt.param_groups]}
    return out


@case("test_param_group_with_lrscheduler_goes_right_direction / test_param_groups_lr / "
      "test_param_groups_weight_decay")
def param_groups(run: Run) -> dict:
    out = {}
    for i, options in enumerate(run.options):
        w, b, x = _weight_bias(run)
        irrelevant = run.param(torch.randn(run.shape(2), generator=torch.Generator().manual_seed(7)))
        weight_kw = dict(options, lr=options.get("lr", 1e-3))
        opt = run.optimizer([dict(params=[w], **weight_kw), dict(params=[b], **dict(weight_kw, weight_decay=0.0)),
                             dict(params=[irrelevant])], lr=1e-28)
        sched = StepLR(opt, gamma=0.9, step_size=5)
        start = run.truth(opt, irrelevant).detach().clone()
        initial = _loss(run, w, b, x).item()
        for s in range(10):
            opt.zero_grad()
            _loss(run, w, b, x).backward()
            run.grads([irrelevant], s)
            opt.step()
            sched.step()
        final = _loss(run, w, b, x).item()
        out[i] = {"right_way": final > initial if options.get("maximize") else final < initial,
                  "irrelevant_unchanged": equal(run.truth(opt, irrelevant), start),
                  "truths": run.truths(opt, [w, b, irrelevant])}
    return out


@case("test_tensor_lr", ranks=True)
def tensor_lr(run: Run) -> dict:
    out = {}
    for i, options in enumerate(run.options):
        results = []
        for lr in (1e-3, torch.tensor(1e-3)):
            params = run.params((10, 5), (10,), seed=1)
            opt = run.optimizer(params, **dict(options, lr=lr))
            for s in range(5):
                run.grads(params, s)
                opt.step()
            results.append(run.truths(opt, params))
        out[i] = {"equal_to_float_lr": equal(*results), "truths": results[1]}
    return out


def _sequential(run: Run, dtype: torch.dtype) -> tuple:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(2, 3, bias=not run.matrices_only), nn.Sigmoid(),
                          nn.Linear(3, 1, bias=not run.matrices_only), nn.Sigmoid())
    model.to(torch.float64 if dtype == torch.float64 else torch.float32)
    if dtype != torch.float64:
        run.model(model)
    gen = torch.Generator().manual_seed(2)
    empty = run.param(torch.rand(() if not run.matrices_only else (1, 1), generator=gen),
                      dtype if dtype == torch.float64 else None)
    empty.grad = torch.rand_like(empty)
    return model, empty


@case("test_foreach_matches_forloop / test_fused_matches_forloop", variants={
    f"{flag},{name}": {"flag": flag, "fixed": dtype}
    for flag in ("foreach", "fused") for name, dtype in (("float64", torch.float64), ("model dtype", None))})
def derived_matches_forloop(run: Run, flag: str, fixed: torch.dtype | None) -> dict:
    """torch's _test_derived_optimizers: forloop vs ``flag`` on an MLP plus a 0-d param (float64 as torch
    runs it, and the config's model dtype), a layer frozen at step 3 and thawed at 5, no grads at step 2."""
    if flag not in run.impls:
        return {"supported": False}
    out = {}
    x = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], dtype=fixed or torch.float32).reshape(3, 2)
    for i, options in enumerate(run.options):
        sides = []
        for value in (False, True):
            model, empty = _sequential(run, fixed or run.dtype)
            model_params = list(model.parameters())
            opt = run.optimizer(model_params + [empty], model=Holder([empty], {"net": model}) if run.wrapped else None,
                                **dict(options, **{flag: value}))
            history = []
            for step in range(7):
                opt.zero_grad()
                if step == 3:
                    model[2].requires_grad_(False)
                if step == 5:
                    model[2].requires_grad_(True)
                if step != 2:
                    (run.forward(model, x) if fixed is None else model(x)).sum().backward()
                opt.step()
                history.append(run.truths(opt, model_params) + [run.state(opt, p) for p in model_params])
            sides.append(history)
        out[i] = {"matches_forloop": _close(sides[0], sides[1]), "truths": sides[1][-1]}
    return out


def _close(a: Any, b: Any) -> bool:
    """torch's tolerance for derived implementations (fused and foreach differ from the forloop in ulps)."""
    if torch.is_tensor(a):
        return torch.allclose(a.double(), b.double(), rtol=1e-4, atol=1e-5) if a.is_floating_point() else torch.equal(a, b)
    if isinstance(a, dict):
        return all(_close(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return all(_close(x, y) for x, y in zip(a, b))
    return a == b


@case("test_complex")
def complex_params(run: Run) -> dict:
    """Complex params (their own main params) next to a param of the model dtype, against view_as_real."""
    out = {}
    for i, options in enumerate(run.options):
        gen = torch.Generator().manual_seed(i)
        complex_params = [run.param(torch.randn(10, 5, dtype=torch.complex64, generator=gen), torch.complex64),
                          run.param(torch.randn(10, dtype=torch.complex64, generator=gen), torch.complex64),
                          run.param(torch.randn(run.shape(10, 5), generator=gen))]
        real_params = [run.param(torch.view_as_real(p.detach()), torch.float32) if p.is_complex()
                       else run.param(p.detach().float()) for p in complex_params]
        complex_opt = run.optimizer(complex_params, **options)
        real_opt = run.optimizer(real_params, **options)
        for s in range(3):
            gen = torch.Generator().manual_seed(100 + s)
            for c, r in zip(complex_params, real_params):
                g = torch.randn(r.shape, generator=gen)
                run.grad(r, g)
                run.grad(c, torch.view_as_complex(g) if c.is_complex() else g)
            real_opt.step()
            complex_opt.step()
        as_real = [torch.view_as_real(run.truth(complex_opt, p).detach()) if p.is_complex()
                   else run.truth(complex_opt, p).detach() for p in complex_params]
        out[i] = {"matches_view_as_real": equal(as_real, run.truths(real_opt, real_params)), "truths": as_real}
    return out


def _rosenbrock(t: torch.Tensor) -> torch.Tensor:
    x, y = t
    return (1 - x) ** 2 + 100 * (y - x ** 2) ** 2


@case("test_complex_2d")
def complex_2d(run: Run) -> dict:
    out = {}
    for i, options in enumerate(run.options):
        a1 = run.param(torch.randn(2, dtype=torch.complex64, generator=torch.Generator().manual_seed(i)),
                       torch.complex64)
        re, im = run.param(a1.detach().real.clone(), torch.float32), run.param(a1.detach().imag.clone(), torch.float32)
        opt1, opt2 = run.optimizer([a1], **options), run.optimizer([re, im], **options)
        same = True
        for _ in range(3):
            opt1.zero_grad()
            opt2.zero_grad()
            _rosenbrock(a1).abs().backward()
            _rosenbrock(torch.complex(re, im)).abs().backward()
            opt1.step()
            opt2.step()
            same = same and equal(a1.detach().real, re.detach()) and equal(a1.detach().imag, im.detach())
        out[i] = {"matches_real_imag": same, "truths": [a1.detach().clone()]}
    return out


@case("test_step_is_noop_when_params_have_no_grad", ranks=True)
def no_grad_step_is_noop(run: Run) -> dict:
    out = {}
    for i, options in enumerate(run.options):
        params = run.params((2, 3), (2, 3), seed=i)
        for p in params:
            p.requires_grad_(False)
        opt = run.optimizer(params, **options)
        before = run.truths(opt, params)
        loss = opt.step(lambda: torch.tensor([1.0]))
        out[i] = {"unchanged": equal(before, run.truths(opt, params)), "loss": loss, "state": len(opt.state)}
    return out


@case("test_step_is_noop_for_zero_grads", ranks=True)
def zero_grad_step_is_noop(run: Run) -> dict:
    out = {}
    for i, options in enumerate(run.options):
        if options.get("weight_decay", 0) != 0:
            continue
        params = run.params((5, 1), seed=i)
        kw = dict(options, lr=1e-5) if run.kind == "adamw" else options
        opt = run.optimizer(params, **kw)
        before = run.truths(opt, params)
        run.grad(params[0], torch.zeros(params[0].shape))
        opt.step(lambda: torch.tensor([1.0]))
        out[i] = {"unchanged": equal(before, run.truths(opt, params))}
    return out


@case("test_non_empty_state", ranks=True)
def non_empty_state(run: Run) -> dict:
    params = run.params((5, 5), (5,))
    opt = run.optimizer(params)
    run.grads(params, 0)
    opt.step()
    return {"non_empty": all(len(opt.state[p]) > 0 for p in params),
            "keys": [sorted(k for k in opt.state[p] if k != MAIN_PARAM) for p in params],
            "states": [run.state(opt, p) for p in params]}


# ---- the cases: state dicts ------------------------------------------------------------------------
def _named(params: list, named: bool) -> list:
    return [(f"name{i}", p) for i, p in enumerate(params)] if named else params


def _without_names(sd: dict) -> dict:
    sd = copy.deepcopy(sd)
    for group in sd["param_groups"]:
        group.pop("param_names", None)
    return sd


@case("test_state_dict_deterministic", ranks=True, variants={   # the two crossings cover both sides named
    f"named={a},{b}": {"named0": a, "named1": b} for a, b in ((True, False), (False, True))})
def state_dict_deterministic(run: Run, named0: bool, named1: bool) -> dict:
    out = {}
    for i, options in enumerate(run.options):
        params = run.params((2, 3), (2,), seed=i)
        opt = run.optimizer(_named(params, named0), **options)
        for s in range(4):
            run.grads(params, s)
            opt.step()
        clones = run.params((2, 3), (2,), seed=i)
        with torch.no_grad():
            for c, p in zip(clones, params):   # the model's values (a clone of the model params)
                c.copy_(p)
        opt_c = run.optimizer(_named(clones, named1), **options)
        opt_c.load_state_dict(copy.deepcopy(opt.state_dict()))
        same = True
        for s in range(4):
            run.grads(params, 10 + s)
            run.grads(clones, 10 + s)
            opt.step()
            opt_c.step()
            same = same and equal(run.truths(opt, params), run.truths(opt_c, clones))
        deterministic = equal(_without_names(opt.state_dict()), _without_names(opt_c.state_dict()))
        opt_c.param_groups.extend(opt_c.param_groups)   # a repeated group has its params' indices
        repeated = equal(_without_names(opt.state_dict())["param_groups"][-1],
                         _without_names(opt_c.state_dict())["param_groups"][-1])
        out[i] = {"same_steps": same, "deterministic": deterministic, "repeated_group": repeated,
                  "truths": run.truths(opt, params)}
    return out


@case("test_can_load_older_state_dict")
def load_older_state_dict(run: Run) -> dict:
    out = {}
    for i, options in enumerate(run.options):
        model, _ = _sequential(run, run.dtype)
        opt = run.optimizer(list(model.parameters()), model=model, **options)
        x = torch.rand(3, 2, generator=torch.Generator().manual_seed(3))
        for _ in range(3):
            opt.zero_grad()
            run.forward(model, x).sum().backward()
            opt.step()
        old = copy.deepcopy(opt.state_dict())
        for group in old["param_groups"]:
            for flag in run.old_flags:
                group.pop(flag, None)
        opt.load_state_dict(old)
        opt.zero_grad()
        run.forward(model, x).sum().backward()
        opt.step()
        out[i] = {"truths": run.truths(opt, list(model.parameters()))}
    return out


@case("test_can_load_from_to_named_state_dict", variants={
    f"named={a},{b}": {"named0": a, "named1": b} for a in (True, False) for b in (True, False)})
def named_state_dict(run: Run, named0: bool, named1: bool) -> dict:
    model, _ = _sequential(run, run.dtype)
    x = torch.rand(3, 2, generator=torch.Generator().manual_seed(3))
    opt = run.optimizer(model.named_parameters() if named0 else model.parameters(), model=model)
    for _ in range(3):
        opt.zero_grad()
        run.forward(model, x).sum().backward()
        opt.step()
    old = copy.deepcopy(opt.state_dict())
    opt2 = run.optimizer(model.named_parameters() if named1 else model.parameters(), model=model)
    opt2.load_state_dict(old)
    opt2.zero_grad()
    run.forward(model, x).sum().backward()
    opt2.step()
    return {"param_names": opt2.state_dict()["param_groups"][0].get("param_names"),
            "truths": run.truths(opt2, list(model.parameters()))}


@case("test_save_load_equality_with_weights_only", ranks=True, variants={"named": {"named": True},
                                                                         "unnamed": {"named": False}})
def save_load_weights_only(run: Run, named: bool) -> dict:
    params = run.params((2, 3), (2,))
    opt = run.optimizer(_named(params, named))
    for s in range(3):
        run.grads(params, s)
        opt.step()
    sd = opt.state_dict()
    equal_after = []
    for weights_only in (False, True):
        buffer = io.BytesIO()
        torch.save(sd, buffer)
        buffer.seek(0)
        equal_after.append(equal(torch.load(buffer, weights_only=weights_only), sd))
    return {"equal": equal_after}


@case("test_load_nontensor_step", ranks=True)
def load_nontensor_step(run: Run) -> dict:
    out = {}
    for i, options in enumerate(run.options):
        params = run.params((2, 3), (2, 3), seed=i)
        opt = run.optimizer(params, **options)
        for s in range(3):
            run.grads(params, s)
            opt.step()
        sd = copy.deepcopy(opt.state_dict())
        for entry in sd["state"].values():
            if torch.is_tensor(entry.get("step")):
                entry["step"] = entry["step"].item()
        opt.load_state_dict(sd)
        run.grads(params, 9)
        opt.step()
        out[i] = {"truths": run.truths(opt, params), "states": [run.state(opt, p) for p in params]}
    return out


def _test_key_pre_hook(optimizer) -> None:
    optimizer.state["test"] = 1


def _test_key_post_hook(optimizer, state_dict):
    ran = "test" in state_dict["state"]
    state_dict["state"].pop("test", None)
    state_dict["ran_state_dict_pre_hook"] = ran
    return state_dict


@case("test_state_dict_pre_hook / test_state_dict_post_hook / test_state_dict_pre_post_hook", ranks=True)
def state_dict_hooks(run: Run) -> dict:
    out = {}
    for hooks in ("pre", "post", "pre+post"):
        params = run.params((2, 3))
        opt = run.optimizer(params)
        if "pre" in hooks:
            opt.register_state_dict_pre_hook(_test_key_pre_hook)
        if "post" in hooks:
            opt.register_state_dict_post_hook(_test_key_post_hook)
        sd = opt.state_dict()
        out[hooks] = {"test": sd["state"].get("test"), "ran": sd.get("ran_state_dict_pre_hook"),
                      "keys": [k for k in sd["state"] if not isinstance(k, int)]}
    return out


def _lr_002(optimizer, state_dict) -> None:
    state_dict["param_groups"][0]["lr"] = 0.002


def _lr_003(optimizer, state_dict) -> dict:
    state_dict = copy.deepcopy(state_dict)
    state_dict["param_groups"][0]["lr"] = 0.003
    return state_dict


def _mark_loaded(optimizer) -> None:
    optimizer.state["ran_load_state_dict_pre_hook2"] = optimizer.param_groups[0]["lr"] == 0.003
    optimizer.state["ran_load_state_dict_post_hook"] = True


@case("test_load_state_dict_pre_hook_and_prepend / test_load_state_dict_post_hook / "
      "test_load_state_dict_pre_post_hook", ranks=True)
def load_state_dict_hooks(run: Run) -> dict:
    params = run.params((2, 3))
    opt = run.optimizer(params)
    sd = opt.state_dict()
    opt.register_load_state_dict_pre_hook(_lr_002)
    opt.load_state_dict(sd)
    first = opt.param_groups[0]["lr"]
    opt.register_load_state_dict_pre_hook(_lr_003, prepend=True)
    opt.load_state_dict(sd)
    prepended = opt.param_groups[0]["lr"]
    params2 = run.params((2, 3))
    opt2 = run.optimizer(params2)
    opt2.register_load_state_dict_pre_hook(_lr_003)
    opt2.register_load_state_dict_post_hook(_mark_loaded)
    opt2.load_state_dict(opt2.state_dict())
    return {"lr": [first, prepended], "flags": [opt2.state["ran_load_state_dict_pre_hook2"],
                                               opt2.state["ran_load_state_dict_post_hook"]],
            "len": len(opt2.state), "contains": "ran_load_state_dict_post_hook" in opt2.state}


@case("state keys that are no param (torch's hook tests write them)", ranks=True)
def non_param_state_keys(run: Run) -> dict:
    params = run.params((2, 3), (2,))
    opt = run.optimizer(params)
    run.grads(params, 0)
    opt.step()
    opt.state["note"] = {"epoch": 3}
    sd = opt.state_dict()
    params2 = run.params((2, 3), (2,))
    with torch.no_grad():   # a resume: the model loaded, then the optimizer
        for p2, p in zip(params2, params):
            p2.copy_(p)
    opt2 = run.optimizer(params2)
    opt2.state["stale"] = 1   # replaced by the load, as torch replaces its whole state
    opt2.load_state_dict(copy.deepcopy(sd))
    others = [k for k in opt2.state if not torch.is_tensor(k)]
    missing = opt2.state["fresh"]   # defaultdict(dict): reading creates {}
    del opt2.state["fresh"]
    return {"saved": sd["state"]["note"], "loaded": others, "value": opt2.state["note"], "default": missing,
            "len": len(opt2.state), "tensor_keys": sum(torch.is_tensor(k) for k in opt2.state)}


# ---- the cases: hooks, copies, printing --------------------------------------------------------------
@case("test_step_pre_hook / test_step_post_hook", ranks=True)
def step_hooks(run: Run) -> dict:
    params = run.params((2, 2))
    opt = run.optimizer(params)
    data = [5, 2]
    handles = [opt.register_step_pre_hook(lambda o, a, k: data.__setitem__(0, data[0] + 2)),
               opt.register_step_post_hook(lambda o, a, k: data.__setitem__(1, data[1] + 2))]
    for s in range(2):
        run.grads(params, s)
        opt.step()
    for handle in handles:
        handle.remove()
    opt.step()
    return {"data": data}


@case("test_step_all_hooks", ranks=True)
def step_all_hooks(run: Run) -> dict:
    params = run.params((2, 2))
    opt = run.optimizer(params)
    other = torch.optim.SGD(params, lr=0.0)   # a second, plain optimizer over the same params
    data = []
    handles = [register_optimizer_step_pre_hook(lambda o, a, k: data.append(0)),
               register_optimizer_step_post_hook(lambda o, a, k: data.append(5))]
    for o in (opt, other):
        handles += [o.register_step_pre_hook(lambda o, a, k: data.append(1)),
                    o.register_step_post_hook(lambda o, a, k: data.append(2))]
    try:
        run.grads(params, 0)
        opt.step()
        other.step()
        opt.step()
    finally:
        for handle in handles:
            handle.remove()
    opt.step()
    other.step()
    return {"data": data}


@case("test_deepcopy_copies_all_public_attrs (and pickle)")
def deepcopy_and_pickle(run: Run) -> dict:
    params = run.params((2, 3), (2, 3))
    opt = run.optimizer(params)
    for s in range(3):
        run.grads(params, s)
        opt.step()
    public = {k for k in vars(opt) if not k.startswith("_")}
    copied = copy.deepcopy(opt)
    revived = pickle.loads(pickle.dumps(opt))
    steps = []
    for o in (opt, copied, revived):   # each copy steps its own params as the original does
        ps = [p for g in o.param_groups for p in g["params"]]
        run.same_role(ps, params)
        run.grads(ps, 7)
        o.step()
        steps.append(run.truths(o, ps))
    return {"public_attrs_copied": public == {k for k in vars(copied) if not k.startswith("_")},
            "copies_step_alike": equal(steps[0], steps[1]) and equal(steps[0], steps[2]), "truths": steps[0]}


@case("test_optimizer_can_be_printed")
def printed(run: Run) -> dict:
    opt = run.optimizer(run.params((2, 3)), lr=0.5)
    text = repr(opt)
    return {"is_text": isinstance(text, str), "names_lr": "lr: 0.5" in text}


@case("test_state_dict_deterministic (param_groups.extend)")
def repeated_group(run: Run) -> dict:
    params = run.params((2, 3), (2,))
    opt = run.optimizer(params)
    opt.param_groups.extend(opt.param_groups)
    run.grads(params, 0)
    opt.step()
    return {"groups": len(opt.param_groups), "sd_groups": [g["params"] for g in opt.state_dict()["param_groups"]],
            "truths": run.truths(opt, params)}


@case("add_param_group (Optimizer API)", ranks=False)
def add_param_group(run: Run) -> dict:
    w, b, x = _weight_bias(run)
    opt = run.optimizer([w], model=Holder([w, b]))   # the model owns b before its group is added
    run.grads([w], 0)
    opt.step()
    opt.defaults["weight_decay"] = 0.05   # seeds the next group, as on a plain optimizer
    opt.add_param_group({"params": [b], "lr": 0.1})
    complete = dict(opt.param_groups[1], params=[run.param(torch.ones(run.shape(3)))])
    if run.wrapped:   # a complete group appended as torch code appends it: the param must be the model's
        opt.model.register_parameter("late", complete["params"][0])
    opt.param_groups.append(complete)
    duplicate = None
    try:
        opt.add_param_group({"params": [w]})
    except ValueError as exc:
        duplicate = "more than one parameter group" in str(exc)
    for s in range(3):
        run.grads([w, b, complete["params"][0]], s + 1)
        opt.step()
    return {"groups": [sorted(k for k in g if k != "params") for g in opt.param_groups],
            "lrs": [g["lr"] for g in opt.param_groups], "duplicate_refused": duplicate,
            "weight_decay": [g["weight_decay"] for g in opt.param_groups],
            "truths": run.truths(opt, [w, b, complete["params"][0]]),
            "sd_groups": [g["params"] for g in opt.state_dict()["param_groups"]]}


@case("test_rosenbrock_sparse (sparse grads: refused by Adam/AdamW/Muon, stepped by SGD)")
def sparse_grads(run: Run) -> dict:
    out = {}
    for name, cls in (("kind", None), ("SGD", torch.optim.SGD)):
        w = run.param(torch.randn(run.shape(4, 3), generator=torch.Generator().manual_seed(5)))
        opt = run.optimizer([w], cls=cls, **({"lr": 0.1, "momentum": 0.9} if cls else {}))
        gen = torch.Generator().manual_seed(6)
        try:
            for _ in range(3):
                dense = torch.randn(w.shape, generator=gen) * (torch.rand(w.shape, generator=gen) > 0.5)
                run.grad(w, dense)
                w.grad = w.grad.to_sparse()
                opt.step()
            out[name] = {"truths": run.truths(opt, [w])}
        except RuntimeError:
            out[name] = "RuntimeError"
    return out


@case("add_param_group (duplicate params in one group: torch warns)")
def duplicate_in_group(run: Run) -> dict:
    w, b, _ = _weight_bias(run)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = run.optimizer([w, w, b])
    messages = sorted({str(c.message)[:60] for c in caught if "duplicate" in str(c.message)})
    run.grads([w, b], 0)
    opt.step()
    return {"warned": messages, "sd_groups": [g["params"] for g in opt.state_dict()["param_groups"]],
            "truths": run.truths(opt, [w, b])}


@case("defaults and param_groups as torch code reads them", ranks=True)
def defaults_and_groups(run: Run) -> dict:
    params = run.params((2, 3), (2,))
    opt = run.optimizer([{"params": params[:1]}, {"params": params[1:], "lr": 0.5}], lr=0.1)
    opt.param_groups[0]["lr"] = 0.25   # an LR scheduler's write
    return {"defaults": dict(opt.defaults),
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
            "params_are_the_model_s": [all(p is q for p, q in zip(g["params"], ps))
                                       for g, ps in zip(opt.param_groups, (params[:1], params[1:]))]}


@case("step(closure) and grads set by hand", ranks=True)
def closure_and_grads_by_hand(run: Run) -> dict:
    out = {}
    for i, options in enumerate(run.options):
        params = run.params((4, 3), (4,), seed=i)
        opt = run.optimizer(params, **options)
        losses = []
        for s in range(3):
            def closure(s=s):
                run.grads(params, s)
                return torch.tensor(float(s))
            losses.append(opt.step(closure))
        out[i] = {"losses": losses, "truths": run.truths(opt, params), "states": [run.state(opt, p) for p in params]}
    return out
