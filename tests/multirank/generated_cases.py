"""Run one generated optimizer case against torch's own optimizer (issue 29, tests/test_generated_cases.py).

A case is a JSON-able dict drawn by the Hypothesis strategies of tests/test_generated_cases.py, so the same
case runs in the pytest process (plain tensors) and in a batch on 2 gloo ranks (torch DTensors with the
drawn placements). :func:`expected` states the documented result of a case before anything runs:

* ``exact``: every param and state bit-equal to the reference (a NaN equals a NaN, whatever its
  sign and payload; every other bit counts);
* ``refuse``: an exception whose message matches a pattern naming the reason.

A case that computes where a refusal is documented, refuses where a result is documented, or computes
a number other than the reference's fails. The reference is torch's optimizer on plain copies of the
tensors ours steps: the local shards on the ranks (compared shard against shard, no collective), the
drawn layout here. Two measured reasons (torch 2.13, CPU): torch's kernels round an element alike only
at the same position in a tensor of the same size (the fused kernel's ``exp_avg_sq`` differs by 1 ulp
between a Shard(1) local of a [5, 3] param and the full tensor), and torch's own optimizers fail on
complex DTensors (``view_as_real`` sharding propagation fails for a 0-dim Replicate; Shard(0) results
differ from the same values on plain tensors), where ours steps the local shards.

* ``FusedAdam``: ``torch.optim.AdamW(fused=True)`` (``Adam(fused=True)`` for ``adam_w_mode=False``) on an
  fp32 workspace: the fp32 param, the fp32 master (``master_weights``), or an fp32 copy of a bf16/fp16
  param rounded back after each step (docs/te_fused_adam.md#rfc-336-update-paths); grads cast to fp32;
  bf16 moments rounded after each step (stored unscaled, docs/te_fused_adam.md#rfc-335-scaling; fp16
  and fp8 moments carry a per-tensor scale and are left to tests/test_fused_adam.py's tolerances);
  contiguous, since torch's fused kernel pairs elements by memory position and ours steps any layout.
  Bit-exact: docs/design.md#41-te_fused_adam_dtensor (the same ``torch._fused_adamw_`` kernel).
* ``foreach_adamw_step``: the same torch optimizer with ``foreach=True`` (``fused=True`` where the group
  sets it) on tensors of the same layout (contiguous ones for a fused group), a tensor lr read as a float on the foreach path (docs/design.md#44-hp_skip_dispatch_adamw).
  Whatever torch refuses there, ours must refuse too.
* ``MainParamsOptimizer``: the same leaf optimizer over fp32 copies of the model params laid out as the
  main params (the fp32 master reference, docs/main_params.md#1-what-torch-code-sees); the model param must be the master rounded to
  its dtype. Whatever that reference refuses, ours must refuse too.
"""
from __future__ import annotations

import re
import traceback
from typing import Any, Optional

import torch
from torch import nn

from npu_fsdp_patches.optim import FusedAdam, MainParamsOptimizer, foreach_adamw_step
from tests.support import bit_mismatches

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64, "complex64": torch.complex64}
FUSED_ADAM_DTYPES = ("float32", "bfloat16", "float16")
STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


# ----------------------------------------------------------------------------- the documented result

def expected(case: dict) -> tuple[str, Optional[str]]:
    """``("exact", None)`` or ``("refuse", pattern)`` for a case, from the docs' claims alone."""
    kind, opts = case["optimizer"], case["options"]
    dtypes = [p["dtype"] for p in case["params"]]
    if kind == "fused_adam":
        reasons = [r for r, on in (("AMSGrad", opts.get("amsgrad")), ("maximize", opts.get("maximize"))) if on]
        if reasons:   # either may be named first
            return "refuse", "|".join(reasons)
        bad = [d for d in dtypes if d not in FUSED_ADAM_DTYPES]
        if bad:
            # TE's FusedAdam refuses these params when they have a grad (docs/te_fused_adam.md
            # #12-constructor-errors, step-time errors), and so does our DTensor path; the message
            # names the dtype or the supported ones (TE: "FusedAdam only support fp16 and fp32.").
            # KNOWN BUG (issue 29): on plain tensors FusedAdam still computes (complex loses its
            # imaginary part, float64 runs in float32); this expectation fails until the refusal is
            # fixed, and must not be weakened. (The strategies give such params a grad.)
            return "refuse", "|".join(sorted(set(bad))) + "|only support"
        return "exact", None
    if kind == "foreach":
        reasons = [r for r in ("capturable", "differentiable") if opts.get(r)]
        if reasons:   # either may be named first (torch's constructor, or ours)
            return "refuse", "|".join(reasons)
        return "exact", None   # or whatever torch's own optimizer refuses (decided at run time)
    if kind == "main_params":
        # every dtype is taken (issue 42): float64/complex params are their own main params, stepped as
        # the reference steps them; add_param_group on a one-leaf wrapper adds the group to the leaf
        return "exact", None
    raise ValueError(f"unknown optimizer {kind!r}")


def in_optimizer(spec: dict) -> bool:
    """Whether a MainParamsOptimizer case hands this param to the leaf optimizer (a frozen param may
    stay in the model only; the wrapper checks only the params it is given)."""
    return not spec.get("frozen") or bool(spec.get("frozen_in_optimizer"))


# ----------------------------------------------------------------------------- tensors of a case

class Layout:
    """Where the case runs: plain tensors (``mesh`` None) or torch DTensors on a 1-D mesh."""

    def __init__(self, mesh: Any = None) -> None:
        self.mesh = mesh

    def placements(self, spec: dict) -> Optional[list]:
        if self.mesh is None:
            return None
        from torch.distributed.tensor import Replicate, Shard
        return [{"R": Replicate(), "S0": Shard(0), "S1": Shard(1)}[spec["placement"]]]

    def make(self, full: torch.Tensor, spec: dict, layout: str) -> torch.Tensor:
        """``full`` (contiguous) as the case's tensor: a DTensor of the placement, or a plain tensor
        with the drawn memory layout (same values)."""
        if self.mesh is not None:
            from tests.multirank.dtensors import distribute_same
            return distribute_same(full.clone(), self.mesh, self.placements(spec))
        if layout == "transposed" and full.dim() == 2:   # always new storage: ``contiguous()`` may
            return full.t().clone(memory_format=torch.contiguous_format).t()   # return ``full`` itself
        if layout == "strided" and full.dim() >= 1:
            wide = torch.zeros((full.shape[0] * 2,) + tuple(full.shape[1:]), dtype=full.dtype)
            view = wide[::2]
            view.copy_(full)
            return view
        return full.clone()


    def make_local(self, full: torch.Tensor, spec: dict, layout: str) -> torch.Tensor:
        """What :meth:`make` gives this rank, as a plain tensor (the reference's operand)."""
        made = self.make(full, spec, layout)
        return made if self.mesh is None else made.to_local().detach().clone()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def initial_value(case: dict, index: int) -> torch.Tensor:
    spec = case["params"][index]
    gen = torch.Generator().manual_seed(case["seed"] * 1000 + index)
    dtype = DTYPES[spec["dtype"]]
    real = torch.randn(spec["shape"], generator=gen, dtype=torch.float64)
    if dtype.is_complex:
        real = torch.complex(real, torch.randn(spec["shape"], generator=gen, dtype=torch.float64))
    return real.to(dtype)


def grad_value(case: dict, index: int, step: int) -> Optional[torch.Tensor]:
    """The full grad of param ``index`` at ``step`` (identical on every rank), or None."""
    spec = case["params"][index]
    if spec["grad"] == "none" or spec.get("frozen"):
        return None
    dtype = DTYPES[spec["grad_dtype"]] if spec["grad"] == "other_dtype" else DTYPES[spec["dtype"]]
    gen = torch.Generator().manual_seed(case["seed"] * 1000 + 100 * (step + 1) + index)
    g = torch.randn(spec["shape"], generator=gen, dtype=torch.float64) * 10.0 ** spec.get("grad_scale", 0)
    if dtype.is_complex:
        g = torch.complex(g, torch.randn(spec["shape"], generator=gen, dtype=torch.float64))
    g = g.to(dtype)
    if spec["grad"] in ("nan", "inf") and g.numel() and step == case["steps"] - 1:
        flat = g.view(-1) if g.is_contiguous() else g.reshape(-1)
        flat[0] = float("nan") if spec["grad"] == "nan" else float("inf")
        flat[-1] = float("-inf") if spec["grad"] == "inf" else flat[-1]
        g = flat.view(g.shape)
    return g


def _set_grad(p: torch.Tensor, grad: Optional[torch.Tensor], attr: str = "grad") -> None:
    if attr == "grad" and grad is not None and grad.dtype != p.dtype:
        p.grad_dtype = None   # newer torch (2.13): a grad of another dtype must be allowed explicitly
    setattr(p, attr, grad)


# ----------------------------------------------------------------------------- comparison

class Mismatch(AssertionError):
    pass


def _same_refusal(ours: str, ours_error: BaseException, reference: str, ref_error) -> None:
    """Raise :class:`Mismatch` unless the reference refused too, with the same exception type."""
    if ref_error is None:
        raise Mismatch(f"{ours} refused where {reference} computes: {type(ours_error).__name__}: {ours_error}")
    if type(ours_error) is not type(ref_error):
        raise Mismatch(f"{ours} refused with {type(ours_error).__name__}: {ours_error}; "
                       f"{reference} with {type(ref_error).__name__}: {ref_error}")


def _canonical_nan(t: torch.Tensor) -> torch.Tensor:
    """``t`` (complex as real pairs) with every NaN replaced by one NaN: the bits of a NaN's sign and
    payload carry no value, and torch's own casts do not keep them alike (fp32 -NaN becomes fp16
    0xFE00 through ``copy_`` and 0x7FFF through ``.to()`` on CPU). Every other bit is compared."""
    t = (torch.view_as_real(t) if t.is_complex() else t).clone(memory_format=torch.contiguous_format)
    if t.is_floating_point():
        t[torch.isnan(t)] = float("nan")
    return t


def _compare(what: str, ours: torch.Tensor, ref: torch.Tensor) -> None:
    ours = _local(ours).detach()
    ref = ref.detach()
    if ours.shape != ref.shape or ours.dtype != ref.dtype:
        raise Mismatch(f"{what}: ours {tuple(ours.shape)} {ours.dtype}, torch {tuple(ref.shape)} {ref.dtype}")
    count, first = bit_mismatches(_canonical_nan(ours), _canonical_nan(ref))
    if count:
        raise Mismatch(f"{what}: {count} element(s) differ from torch's bits, first {first}")


def hyper_kwargs(hyper: dict, *, tensor_lr: bool = True) -> dict:
    lr = torch.tensor(hyper["lr"]) if hyper.get("lr_tensor") else hyper["lr"]
    if not tensor_lr and isinstance(lr, torch.Tensor):
        lr = lr.item()   # the tensor's own value (an fp32 tensor does not hold 1e-3 exactly)
    out = {"lr": lr,
           "betas": tuple(hyper["betas"]), "eps": hyper["eps"], "weight_decay": hyper["weight_decay"]}
    return out


def _build(cls: Any, case: dict, params: list, extra: dict, *, tensor_lr: bool = True,
           group_extra: Optional[list] = None) -> torch.optim.Optimizer:
    """``cls`` over the case's groups; the groups after the first via ``add_param_group`` when drawn."""
    groups = []
    for gi, hyper in enumerate(case["groups"]):
        members = [p for p, spec in zip(params, case["params"]) if spec["group"] == gi]
        group = {"params": members, **hyper_kwargs(hyper, tensor_lr=tensor_lr)}
        group.update((group_extra or [{}] * len(case["groups"]))[gi])
        groups.append(group)
    if case.get("add_param_group") and len(groups) > 1:
        opt = cls(groups[:1], **extra)
        for group in groups[1:]:
            opt.add_param_group(group)
        return opt
    return cls(groups, **extra)


def _refused(exc: BaseException, pattern: str) -> Optional[str]:
    """None when ``exc`` is the documented refusal, else why not."""
    if not re.search(pattern, str(exc), re.IGNORECASE):
        return f"refused with {type(exc).__name__}: {exc} (expected the reason /{pattern}/)"
    return None


# ----------------------------------------------------------------------------- FusedAdam

def run_fused_adam(case: dict, layout: Layout) -> None:
    opts = case["options"]
    specs = case["params"]
    fulls = [initial_value(case, i) for i in range(len(specs))]
    params = [nn.Parameter(layout.make(f, s, s["layout"]), requires_grad=not s.get("frozen"))
              for f, s in zip(fulls, specs)]
    extra = {"adam_w_mode": opts["adam_w_mode"], "master_weights": opts["master_weights"],
             "use_decoupled_grad": opts["decoupled_grad"]}
    if opts.get("amsgrad"):
        extra["amsgrad"] = True
    if opts.get("maximize"):
        extra["maximize"] = True
    moments = {key: opts.get(f"{key}_dtype", "float32") for key in ("exp_avg", "exp_avg_sq")}
    extra.update({f"{key}_dtype": DTYPES[dt] for key, dt in moments.items() if dt != "float32"})
    attr = "decoupled_grad" if opts["decoupled_grad"] else "grad"
    opt = _build(FusedAdam, case, params, extra)
    if expected(case)[0] == "refuse":   # no reference: ours must raise, here or in step
        for step in range(case["steps"]):
            for i, (p, s) in enumerate(zip(params, specs)):
                g = grad_value(case, i, step)
                _set_grad(p, None if g is None else layout.make(g, s, s.get("grad_layout", s["layout"])), attr)
            opt.step()
        return
    # the reference: torch's fused kernel on fp32 workspaces (contiguous, full tensors)
    work = [nn.Parameter(layout.make_local(f.to(torch.float32), s, "contiguous")) for f, s in zip(fulls, specs)]
    ref_cls = torch.optim.AdamW if opts["adam_w_mode"] else torch.optim.Adam
    ref = _build(ref_cls, case, work, {"fused": True})
    round_back = not opts["master_weights"]
    for step in range(case["steps"]):
        for i, (p, w, s) in enumerate(zip(params, work, specs)):
            g = grad_value(case, i, step)
            gl = None if g is None else layout.make(g, s, s.get("grad_layout", s["layout"]))
            _set_grad(p, gl, attr)
            w.grad = None if g is None else layout.make_local(g.to(torch.float32), s, "contiguous")
        opt.step()
        ref.step()
        with torch.no_grad():   # a bf16 moment is stored rounded after each step (no scale)
            for key, dt in moments.items():
                for st in (ref.state[w] for w in work if w in ref.state):
                    if dt == "bfloat16":
                        _local(st[key]).copy_(_local(st[key]).to(torch.bfloat16).float())
        if round_back:   # a bf16/fp16 param without master weights is its own fp32 copy each step
            with torch.no_grad():
                for w, f in zip(work, fulls):
                    if f.dtype != torch.float32:
                        _local(w).copy_(_local(w).to(f.dtype).float())
    for i, (p, w, s, f) in enumerate(zip(params, work, specs, fulls)):
        name = f"param {i} ({s['dtype']} {s['shape']})"
        _compare(name, p, _local(w).detach().to(f.dtype))
        if specs[i]["grad"] == "none" or s.get("frozen"):
            continue
        for key, dt in moments.items():
            _compare(f"{name} {key}", opt.state[p][key], _local(ref.state[w][key]).to(DTYPES[dt]))
        if opts["master_weights"] and f.dtype != torch.float32:
            _compare(f"{name} master_param", opt.state[p]["master_param"], _local(w).detach())


# ----------------------------------------------------------------------------- foreach_adamw_step

def _torch_flags(opts: dict) -> dict:
    flags = {}
    for key in ("amsgrad", "maximize", "capturable", "differentiable"):
        if opts.get(key):
            flags[key] = True
    if opts.get("fused"):
        flags["fused"] = True
    elif opts.get("foreach") is not None:
        flags["foreach"] = opts["foreach"]
    return flags


def run_foreach(case: dict, layout: Layout) -> Optional[str]:
    """Run ours; returns the torch reference's refusal (then ours must have refused) or None."""
    opts = case["options"]
    specs = case["params"]
    cls = getattr(torch.optim, opts["cls"])
    fulls = [initial_value(case, i) for i in range(len(specs))]
    params = [nn.Parameter(layout.make(f, s, s["layout"]), requires_grad=not s.get("frozen"))
              for f, s in zip(fulls, specs)]
    fused = bool(opts.get("fused"))
    # torch's fused kernel pairs elements by memory position, and ours hands it contiguous operands
    # (docs/design.md#44-hp_skip_dispatch_adamw): its reference is contiguous
    ref_layouts = [("contiguous", "contiguous") if fused else (s["layout"], s.get("grad_layout", s["layout"]))
                   for s in specs]
    refs = [nn.Parameter(layout.make_local(f, s, rl[0]), requires_grad=not s.get("frozen"))
            for f, s, rl in zip(fulls, specs, ref_layouts)]
    ref_flags = {k: v for k, v in _torch_flags(opts).items() if k not in ("foreach",)}
    if not fused:
        ref_flags["foreach"] = True
    ours_error = ref_error = None
    try:
        ref = _build(cls, case, refs, ref_flags, tensor_lr=fused)
    except Exception as exc:
        ref, ref_error = None, exc
    try:
        opt = _build(cls, case, params, _torch_flags(opts))
    except Exception as exc:
        opt, ours_error = None, exc
    for step in range(case["steps"]):
        for i, (p, r, s) in enumerate(zip(params, refs, specs)):
            g = grad_value(case, i, step)
            _set_grad(p, None if g is None else layout.make(g, s, s.get("grad_layout", s["layout"])))
            _set_grad(r, None if g is None else layout.make_local(g, s, ref_layouts[i][1]))
        if ref is not None and ref_error is None:
            try:
                ref.step()
            except Exception as exc:
                ref_error = exc
        if opt is not None and ours_error is None:
            try:
                foreach_adamw_step(opt)
            except Exception as exc:
                ours_error = exc
    if ours_error is not None:
        if expected(case)[0] == "refuse":
            raise ours_error   # checked against the documented refusal by the caller
        _same_refusal("foreach_adamw_step", ours_error, "torch", ref_error)
        return "both"   # torch's own refusal, passed through
    if ref_error is not None:
        raise Mismatch(f"foreach_adamw_step computed where torch's {opts['cls']}({ref_flags}) refuses: "
                       f"{type(ref_error).__name__}: {ref_error}")
    for i, (p, r, s) in enumerate(zip(params, refs, specs)):
        name = f"param {i} ({s['dtype']} {s['shape']})"
        _compare(name, p, _local(r).detach())
        for key in STATE_KEYS:
            if key in ref.state[r] or key in opt.state[p]:
                if key not in opt.state[p] or key not in ref.state[r]:
                    raise Mismatch(f"{name}: state {key!r} only on one side")
                _compare(f"{name} {key}", opt.state[p][key], _local(ref.state[r][key]))
        if "step" in ref.state[r]:
            _compare(f"{name} step", opt.state[p]["step"], ref.state[r]["step"])
    return None


# ----------------------------------------------------------------------------- MainParamsOptimizer

def _master_dtype(t: torch.Tensor, like: Optional[torch.dtype] = None) -> torch.Tensor:
    """``t`` as the reference's master holds it: fp32 for a bf16/fp16 (or fp32) param, else its own dtype
    (float64 and complex params are their own main params)."""
    dtype = like or t.dtype
    return t.float() if dtype in (torch.bfloat16, torch.float16, torch.float32) else t.to(dtype)


def run_main_params(case: dict, layout: Layout) -> None:
    opts = case["options"]
    specs = case["params"]
    cls = getattr(torch.optim, opts["cls"])
    fulls = [initial_value(case, i) for i in range(len(specs))]
    model = nn.Module()
    params = []
    for f, s in zip(fulls, specs):
        p = nn.Parameter(layout.make(f, s, s["layout"]), requires_grad=not s.get("frozen"))
        model.register_parameter(s["name"], p)
        params.append(p)
    in_opt = [in_optimizer(s) for s in specs]
    flags = _torch_flags(opts)
    opt_params = [p for p, keep in zip(params, in_opt) if keep]
    opt_specs = [s for s, keep in zip(specs, in_opt) if keep]
    leaf = _build(cls, {**case, "params": opt_specs}, opt_params, flags)
    wrapped = MainParamsOptimizer(leaf, model)
    if opts.get("add_group_after_wrap"):
        wrapped.add_param_group({"params": []})   # an empty group: the leaf takes it, nothing else changes
    # the reference's masters are laid out as the main params: an fp32/float64/complex param is its own, a
    # bf16/fp16 param's is contiguous; the grads are laid out like them
    master_layouts = [s["layout"] if f.dtype not in (torch.bfloat16, torch.float16) else "contiguous"
                      for f, s in zip(fulls, specs)]
    masters = [nn.Parameter(layout.make_local(_master_dtype(f), s, ml)) if keep else None
               for f, s, ml, keep in zip(fulls, specs, master_layouts, in_opt)]
    ref_error = None
    try:
        ref = _build(cls, {**case, "params": opt_specs}, [m for m in masters if m is not None], flags)
    except Exception as exc:
        ref, ref_error = None, exc
    ours_error = None
    for step in range(case["steps"]):
        for i, (p, m, s) in enumerate(zip(params, masters, specs)):
            g = grad_value(case, i, step)
            gl = None if g is None else layout.make(g, s, s.get("grad_layout", s["layout"]))
            if s["grad"] == "other_dtype":
                _set_grad(p, None)
                p.main_grad = gl   # the documented fp32 main-grad path (Megatron / hyper)
            else:
                _set_grad(p, gl)
            if m is not None:
                m.grad = None if g is None else layout.make_local(_master_dtype(g, fulls[i].dtype), s,
                                                                  master_layouts[i])
        if ref is not None and ref_error is None:
            try:
                ref.step()
            except Exception as exc:
                ref_error = exc
        if ours_error is None:
            try:
                wrapped.step()
            except Exception as exc:
                ours_error = exc
        wrapped.zero_grad()
    if ours_error is not None:
        _same_refusal("MainParamsOptimizer", ours_error, "the fp32 reference", ref_error)
        return   # both refused: the leaf's own refusal, passed through
    if ref_error is not None:
        raise Mismatch(f"MainParamsOptimizer computed where the fp32 reference refuses: "
                       f"{type(ref_error).__name__}: {ref_error}")
    for i, (p, m, s, f) in enumerate(zip(params, masters, specs, fulls)):
        name = f"param {s['name']} ({s['dtype']} {s['shape']})"
        if m is None:
            _compare(f"{name} (not in the optimizer)", p, layout.make_local(f, s, "contiguous"))
            continue
        _compare(name, p, _local(m).detach().to(f.dtype))
        _compare(f"{name} main param", wrapped.main_param(p), _local(m).detach())
        for key in STATE_KEYS:
            if key in ref.state[m]:
                _compare(f"{name} {key}", wrapped.state[p][key], _local(ref.state[m][key]))


# ----------------------------------------------------------------------------- one case, a batch

RUNNERS = {"fused_adam": run_fused_adam, "foreach": run_foreach, "main_params": run_main_params}


def check_case(case: dict, layout: Optional[Layout] = None) -> Optional[str]:
    """None when the case gives its documented result, else what went wrong."""
    layout = layout or Layout()
    outcome, pattern = expected(case)
    try:
        RUNNERS[case["optimizer"]](case, layout)
    except Mismatch as exc:
        return f"wrong result: {exc}"
    except Exception as exc:
        if outcome == "refuse":
            return _refused(exc, pattern)
        return f"refused where a result is documented: {type(exc).__name__}: {exc}\n" + \
            "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)[-3:])
    if outcome == "refuse":
        return f"computed where a refusal is documented (/{pattern}/)"
    return None


def case_batch(rank: int, world: int, cases_file: str) -> list:
    """Rank side: every case of ``cases_file`` (JSON; a batch outgrows an environment variable) on
    torch DTensors over a 1-D mesh of all ranks; no collective per case."""
    import json

    from torch.distributed.device_mesh import init_device_mesh
    with open(cases_file) as fh:
        cases = json.load(fh)
    layout = Layout(init_device_mesh("cpu", (world,)))
    return [check_case(case, layout) for case in cases]
