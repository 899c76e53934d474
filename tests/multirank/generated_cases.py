"""Run one generated optimizer case against torch's own optimizer (issue 29, tests/test_generated_cases.py).

A case is a JSON-able dict drawn by the Hypothesis strategies of tests/test_generated_cases.py, so the same
case runs in the pytest process (plain tensors) and in a batch on 2 gloo ranks (torch DTensors with the
drawn placements). :func:`expected` states the documented result of a case before anything runs:

* ``exact``: every param and state bit-equal to the reference (a NaN equals a NaN, whatever its
  sign and payload; every other bit counts);
* ``refuse``: an exception whose message matches a pattern naming the reason.

A case that computes where a refusal is documented, refuses where a result is documented, or computes
a number other than the reference's fails. A case with a ``checkpoint`` is resumed at step ``resume_at``
(:func:`run_fused_adam`, :func:`run_main_params`) and must still equal the uninterrupted reference (for
a full state: the reference resumed from the same state). The reference is torch's optimizer on plain
copies of the tensors ours steps: the local shards on the ranks (compared shard against shard, no
collective), the drawn layout here. Two measured reasons (torch 2.13, CPU): torch's kernels round an element alike only
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

import contextlib
import copy
import os
import re
import tempfile
import traceback
from typing import Any, Iterator, Optional

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
        # the reference steps them; add_param_group on a one-leaf wrapper adds the group to the leaf,
        # on a wrapper of several leaves it is refused (which leaf is meant?)
        if opts.get("add_group_after_wrap") and len(leaf_classes(case)) > 1:
            return "refuse", r"which one takes the new group"
        return "exact", None
    raise ValueError(f"unknown optimizer {kind!r}")


def in_optimizer(spec: dict) -> bool:
    """Whether a MainParamsOptimizer case hands this param to the leaf optimizer (a frozen param may
    stay in the model only; the wrapper checks only the params it is given)."""
    return not spec.get("frozen") or bool(spec.get("frozen_in_optimizer"))


# ----------------------------------------------------------------------------- tensors of a case

#: the meshes of the 2-rank batch (a spec's ``mesh``, default ``[2]``): both ranks on one dim, and two
#: mesh dims with one of size 1, where a param has one placement per mesh dim (HSDP's (Replicate,
#: Shard), 2-D sharding, and FSDP2's (_StridedShard(d, split_factor=2), Shard(d)) of a param that TP
#: shards on the same dim: torch/distributed/fsdp/_fully_shard/_fsdp_param.py, ``_StridedShard``)
MESH_SHAPES = ([2], [2, 1], [1, 2])


def placement(name: str, mesh_shape: list) -> Any:
    """``"R"``, ``"S0"``, ``"S1"``, or ``"SS0"``/``"SS1"`` (FSDP2's strided shard over a later mesh dim
    that shards the same tensor dim: split factor the size of that dim) as a torch placement."""
    from torch.distributed.tensor import Replicate, Shard
    if name == "R":
        return Replicate()
    if name.startswith("SS"):
        from torch.distributed.tensor.placement_types import _StridedShard
        return _StridedShard(int(name[2:]), split_factor=mesh_shape[-1])
    return Shard(int(name[1:]))


class Layout:
    """Where the case runs: plain tensors (``meshes`` None) or torch DTensors on the meshes of
    :data:`MESH_SHAPES` (built once per batch, by every rank); ``workdir`` is shared by the ranks
    (DCP checkpoints)."""

    def __init__(self, meshes: Optional[dict] = None, workdir: Optional[str] = None) -> None:
        self.meshes = meshes
        self.workdir = workdir
        self._checkpoints = 0

    @property
    def distributed(self) -> bool:
        return self.meshes is not None

    def mesh(self, spec: dict) -> Any:
        return self.meshes[tuple(spec.get("mesh", [2]))]

    def placements(self, spec: dict) -> Optional[list]:
        if not self.distributed:
            return None
        return [placement(name, spec.get("mesh", [2])) for name in spec["placement"].split(",")]

    def make(self, full: torch.Tensor, spec: dict, layout: str) -> torch.Tensor:
        """``full`` (contiguous) as the case's tensor: a DTensor of the placement, or a plain tensor
        with the drawn memory layout (same values)."""
        if self.distributed:
            from tests.multirank.dtensors import distribute_same
            return distribute_same(full.clone(), self.mesh(spec), self.placements(spec))
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
        return made.to_local().detach().clone() if self.distributed else made

    def copy(self, t: torch.Tensor, spec: dict) -> torch.Tensor:
        """A new tensor of ``t``'s layout and values, with no collective (a resumed run's param)."""
        if self.distributed:
            return type(t).from_local(_local(t).detach().clone(), t.device_mesh, t.placements,
                                      shape=t.shape, stride=t.stride(), run_check=False)
        return self.make(t.detach().clone(memory_format=torch.contiguous_format), spec, spec["layout"])

    @contextlib.contextmanager
    def checkpoint_dir(self) -> Iterator[str]:
        """A new directory for one DCP checkpoint: on the ranks the same path on each (cases run in
        the same order everywhere), here a temporary one."""
        if self.distributed:
            self._checkpoints += 1
            yield os.path.join(self.workdir, f"checkpoint{self._checkpoints}")
            return
        with tempfile.TemporaryDirectory(prefix="generated_case_") as path:
            yield path


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
    if spec["grad"] == "none" or spec.get("frozen") or (spec["grad"] == "late" and step < late_start(case)):
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


def late_start(case: dict) -> int:
    """The first step at which a ``"late"`` grad is given: the resume step of a resumed case (the param
    has no state when saved, and gets one after the load), else the middle step."""
    return case.get("resume_at") or case["steps"] // 2


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

def _fused_adam_options(opts: dict) -> tuple[dict, dict, str]:
    """FusedAdam's constructor kwargs, the moments' dtype names, and the attribute grads go to."""
    extra = {"adam_w_mode": opts["adam_w_mode"], "master_weights": opts["master_weights"],
             "use_decoupled_grad": opts["decoupled_grad"]}
    if opts.get("amsgrad"):
        extra["amsgrad"] = True
    if opts.get("maximize"):
        extra["maximize"] = True
    moments = {key: opts.get(f"{key}_dtype", "float32") for key in ("exp_avg", "exp_avg_sq")}
    extra.update({f"{key}_dtype": DTYPES[dt] for key, dt in moments.items() if dt != "float32"})
    return extra, moments, "decoupled_grad" if opts["decoupled_grad"] else "grad"


def _set_grads(case: dict, params: list, layout: Layout, step: int, attr: str = "grad",
               grad_layout: Optional[str] = None) -> None:
    for i, (p, s) in enumerate(zip(params, case["params"])):
        g = grad_value(case, i, step)
        where = grad_layout or s.get("grad_layout", s["layout"])
        _set_grad(p, None if g is None else layout.make(g, s, where), attr)


def _fused_adam_resumed(case: dict, layout: Layout, params: list, opt: FusedAdam, extra: dict) -> tuple:
    """A new FusedAdam over copies of ``params`` that loads ``opt``'s state dict (its own layout)."""
    state = copy.deepcopy(opt.state_dict())
    resumed = [nn.Parameter(layout.copy(p, s), requires_grad=p.requires_grad)
               for p, s in zip(params, case["params"])]
    new = _build(FusedAdam, case, resumed, extra)
    new.load_state_dict(state)
    return resumed, new


def _fused_adam_from_full_state(case: dict, layout: Layout, fulls: list, extra: dict, attr: str,
                                ref_cls: Any) -> tuple:
    """``resume_at`` steps of a one-process FusedAdam on the full tensors; its state dict (full, plain
    tensors: a checkpoint of an unsharded run) loaded into a new FusedAdam on ``layout``, and torch's
    reference resumed from this rank's pieces of the same full state, cut by the harness."""
    specs = case["params"]
    saved_params = [nn.Parameter(f.clone(), requires_grad=not s.get("frozen")) for f, s in zip(fulls, specs)]
    saved_opt = _build(FusedAdam, case, saved_params, extra)
    for step in range(case["resume_at"]):
        _set_grads(case, saved_params, Layout(), step, attr, grad_layout="contiguous")
        saved_opt.step()
    values = [p.detach() for p in saved_params]
    params = [nn.Parameter(layout.make(v, s, s["layout"]), requires_grad=not s.get("frozen"))
              for v, s in zip(values, specs)]
    opt = _build(FusedAdam, case, params, extra)
    opt.load_state_dict(copy.deepcopy(saved_opt.state_dict()))
    index = {id(p): i for i, p in enumerate(saved_params)}
    order = [(index[id(p)], group["step"]) for group in saved_opt.param_groups for p in group["params"]]
    entries = {order[k][0]: (entry, order[k][1]) for k, entry in saved_opt.state_dict()["state"].items()}
    masters = [entries[i][0]["master_param"] if i in entries and "master_param" in entries[i][0] else v.float()
               for i, v in enumerate(values)]
    work = [nn.Parameter(layout.make_local(m.float(), s, "contiguous")) for m, s in zip(masters, specs)]
    ref = _build(ref_cls, case, work, {"fused": True})
    for i, (entry, step) in entries.items():
        ref.state[work[i]] = {"step": torch.tensor(float(step)), **{
            key: layout.make_local(entry[key], specs[i], "contiguous") for key in ("exp_avg", "exp_avg_sq")}}
    return params, opt, work, ref


def run_fused_adam(case: dict, layout: Layout) -> None:
    """Optionally resumed at step ``resume_at`` (``checkpoint``): ``"own"`` loads the run's own state
    dict into a new optimizer; ``"full"`` loads the full state of a one-process run (every placement
    takes its piece of each full tensor: docs/te_fused_adam.md#rfc-339-state-dict)."""
    opts = case["options"]
    specs = case["params"]
    extra, moments, attr = _fused_adam_options(opts)
    fulls = [initial_value(case, i) for i in range(len(specs))]
    if expected(case)[0] == "refuse":   # no reference: ours must raise, here or in step
        params = [nn.Parameter(layout.make(f, s, s["layout"]), requires_grad=not s.get("frozen"))
                  for f, s in zip(fulls, specs)]
        opt = _build(FusedAdam, case, params, extra)
        for step in range(case["steps"]):
            _set_grads(case, params, layout, step, attr)
            opt.step()
        return
    # the reference: torch's fused kernel on fp32 workspaces (contiguous, full tensors)
    ref_cls = torch.optim.AdamW if opts["adam_w_mode"] else torch.optim.Adam
    checkpoint, first = case.get("checkpoint", "none"), 0
    if checkpoint == "full":
        params, opt, work, ref = _fused_adam_from_full_state(case, layout, fulls, extra, attr, ref_cls)
        first = case["resume_at"]
    else:
        params = [nn.Parameter(layout.make(f, s, s["layout"]), requires_grad=not s.get("frozen"))
                  for f, s in zip(fulls, specs)]
        opt = _build(FusedAdam, case, params, extra)
        work = [nn.Parameter(layout.make_local(f.to(torch.float32), s, "contiguous")) for f, s in zip(fulls, specs)]
        ref = _build(ref_cls, case, work, {"fused": True})
    round_back = not opts["master_weights"]
    for step in range(first, case["steps"]):
        if checkpoint == "own" and step == case["resume_at"]:
            params, opt = _fused_adam_resumed(case, layout, params, opt, extra)
        _set_grads(case, params, layout, step, attr)
        for i, (w, s) in enumerate(zip(work, specs)):
            g = grad_value(case, i, step)
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

def leaf_classes(case: dict) -> list[str]:
    """The leaf optimizers of a MainParamsOptimizer case: ``cls``, then ``second`` if drawn; param
    group ``gi`` of the case belongs to leaf ``gi % len(leaves)``."""
    opts = case["options"]
    return [opts["cls"]] + ([opts["second"]] if opts.get("second") else [])


def saved_with_state(case: dict, spec: dict) -> bool:
    """Whether a resumed case's saved state dict has an entry for this param of the optimizer: its
    main param (bf16/fp16), or its leaf's state (none for a frozen param, a grad ``"none"`` or
    ``"late"``, nor in an SGD leaf without momentum)."""
    if spec["dtype"] in ("bfloat16", "float16"):
        return True
    if spec.get("frozen") or spec["grad"] in ("none", "late"):
        return False
    names = leaf_classes(case)
    name = names[spec["group"] % len(names)]
    return not (_leaf_class(name) is torch.optim.SGD
                and _leaf_kwargs(name, case["groups"][spec["group"]])["momentum"] == 0)


def _leaf_kwargs(name: str, hyper: dict) -> dict:
    """A group's hyperparameters as leaf ``name`` takes them: Muon and SGD read ``betas[0]`` as their
    momentum; ``"SGD0"`` is SGD without momentum, which keeps no state yet steps its params."""
    if name in ("Adam", "AdamW"):
        return hyper_kwargs(hyper)
    lr = torch.tensor(hyper["lr"]) if hyper.get("lr_tensor") and name == "Muon" else hyper["lr"]
    kwargs = {"lr": lr, "momentum": 0.0 if name == "SGD0" else hyper["betas"][0],
              "weight_decay": hyper["weight_decay"]}
    if _leaf_class(name) is getattr(torch.optim, "Muon", None):
        kwargs["ns_steps"] = 1   # the wrapper is under test, not Muon's math: one Newton-Schulz step (of 5)
    return kwargs


def _leaf_class(name: str) -> Any:
    """torch's class; torch < 2.9 has no ``torch.optim.Muon``: a momentum SGD, which keeps a
    ``momentum_buffer`` state as Muon does (as tests/main_params_model.py)."""
    if name == "SGD0" or (name == "Muon" and not hasattr(torch.optim, "Muon")):
        return torch.optim.SGD
    return getattr(torch.optim, name)


def _main_params_leaves(case: dict, params: list, specs: list) -> list:
    """The case's leaf optimizers over ``params`` (the optimizer's params, described by ``specs``)."""
    names = leaf_classes(case)
    leaves = []
    for li, name in enumerate(names):
        groups = [{"params": [p for p, s in zip(params, specs) if s["group"] == gi],
                   **_leaf_kwargs(name, hyper)}
                  for gi, hyper in enumerate(case["groups"]) if gi % len(names) == li]
        cls = _leaf_class(name)
        flags = _torch_flags(case["options"]) if name in ("Adam", "AdamW") else {}
        if case.get("add_param_group") and len(groups) > 1:
            leaf = cls(groups[:1], **flags)
            for group in groups[1:]:
                leaf.add_param_group(group)
        else:
            leaf = cls(groups, **flags)
        leaves.append(leaf)
    return leaves


def _main_params_wrapper(case: dict, tensors: list) -> tuple:
    """``(model, params, wrapper)``: the model's params are ``tensors``; the leaves are handed over
    as one optimizer, a list, a dict or an :class:`OptimizerChain` (``container``); an empty group is
    added to the wrapper with ``add_group_after_wrap``."""
    from npu_fsdp_patches.optim.muon_routing import OptimizerChain
    specs = case["params"]
    model = nn.Module()
    params = []
    for t, s in zip(tensors, specs):
        p = nn.Parameter(t, requires_grad=not s.get("frozen"))
        model.register_parameter(s["name"], p)
        params.append(p)
    kept = [(p, s) for p, s in zip(params, specs) if in_optimizer(s)]
    leaves = _main_params_leaves(case, [p for p, _ in kept], [s for _, s in kept])
    container = case["options"].get("container", "list")
    optimizer = (leaves[0] if len(leaves) == 1 else
                 {"first": leaves[0], "second": leaves[1]} if container == "dict" else
                 OptimizerChain({"adamw": leaves[0], "muon": leaves[1]}) if container == "chain" else leaves)
    wrapped = MainParamsOptimizer(optimizer, model)
    if case["options"].get("add_group_after_wrap"):
        wrapped.add_param_group({"params": []})   # an empty group: the leaf takes it, nothing else changes
    return model, params, wrapped


def _prime_like_torch(leaves: list) -> None:
    """What torch's state-dict API does to an optimizer without any state (it steps it once at lr 0
    with zero grads: ``_init_optim_state``, torch/distributed/checkpoint/state_dict.py), done to
    reference leaves where it is done to a wrapper (whose state spans all its leaves): the saved one
    (then the reference goes on from it) and the new one it loads into (where torch may refuse)."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state
    if not any(leaf.state for leaf in leaves):
        for leaf in leaves:
            leaf.zero_grad(set_to_none=True)   # as the wrapper's, cleared after each step
            _init_optim_state(leaf)


def _resume_main_params(case: dict, layout: Layout, fulls: list, model: nn.Module, wrapped: Any) -> tuple:
    """A new model, leaves and wrapper that resume ``wrapped`` through ``checkpoint``: its own
    ``state_dict``/``load_state_dict``, torch's ``get/set_optimizer_state_dict`` (nested or
    flattened), or a DCP checkpoint of model and optimizer (``save_checkpoint``/``load_checkpoint``,
    which load the model too: the new one starts from the initial values)."""
    specs = case["params"]
    how = case["checkpoint"]
    tensors = ([layout.make(f, s, s["layout"]) for f, s in zip(fulls, specs)] if how == "dcp" else
               [layout.copy(p, s) for p, s in zip(model.parameters(), specs)])
    new_model, new_params, new = _main_params_wrapper(case, tensors)
    if how == "state_dict":
        new.load_state_dict(copy.deepcopy(wrapped.state_dict()))
    elif how in ("torch_api", "torch_api_flat"):
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                             set_optimizer_state_dict)
        # strict=False: a param without state (no grad so far) has none to load; torch >= 2.13
        # refuses that for a param that requires grad unless told so, for any optimizer
        options = StateDictOptions(flatten_optimizer_state_dict=how == "torch_api_flat", strict=False)
        saved = get_optimizer_state_dict(model, wrapped, options=options)
        set_optimizer_state_dict(new_model, new, copy.deepcopy(saved), options=options)
    elif how == "dcp":
        from npu_fsdp_patches.optim.main_params_checkpoint import load_checkpoint, save_checkpoint
        with layout.checkpoint_dir() as path:
            save_checkpoint(path, model, wrapped)
            load_checkpoint(path, new_model, new)
    else:
        raise ValueError(f"unknown checkpoint {how!r}")
    return new_model, new_params, new


def _master_dtype(t: torch.Tensor, like: Optional[torch.dtype] = None) -> torch.Tensor:
    """``t`` as the reference's master holds it: fp32 for a bf16/fp16 (or fp32) param, else its own dtype
    (float64 and complex params are their own main params)."""
    dtype = like or t.dtype
    return t.float() if dtype in (torch.bfloat16, torch.float16, torch.float32) else t.to(dtype)


def run_main_params(case: dict, layout: Layout) -> None:
    """Optionally resumed at step ``resume_at`` through ``checkpoint`` (:func:`_resume_main_params`),
    with leaves where some params have no state yet (no grad so far, frozen, a ``"late"`` grad)."""
    specs = case["params"]
    fulls = [initial_value(case, i) for i in range(len(specs))]
    model, params, wrapped = _main_params_wrapper(case, [layout.make(f, s, s["layout"])
                                                         for f, s in zip(fulls, specs)])
    in_opt = [in_optimizer(s) for s in specs]
    opt_specs = [s for s, keep in zip(specs, in_opt) if keep]
    # the reference's masters are laid out as the main params: an fp32/float64/complex param is its own, a
    # bf16/fp16 param's is contiguous; the grads are laid out like them
    master_layouts = [s["layout"] if f.dtype not in (torch.bfloat16, torch.float16) else "contiguous"
                      for f, s in zip(fulls, specs)]
    masters = [nn.Parameter(layout.make_local(_master_dtype(f), s, ml), requires_grad=not s.get("frozen"))
               if keep else None for f, s, ml, keep in zip(fulls, specs, master_layouts, in_opt)]
    ref_error = None
    try:
        ref = _main_params_leaves(case, [m for m in masters if m is not None], opt_specs)
    except Exception as exc:
        ref, ref_error = None, exc
    ours_error = None
    checkpoint = case.get("checkpoint", "none")
    for step in range(case["steps"]):
        if checkpoint != "none" and step == case["resume_at"] and ours_error is None:
            if ref is not None and ref_error is None and checkpoint != "state_dict":
                try:   # torch's priming step may refuse (a tensor lr on the foreach path): so must ours
                    _prime_like_torch(ref)   # the saved optimizer, if it has no state
                    _prime_like_torch(_main_params_leaves(case, [   # the new one it loads into
                        nn.Parameter(m.detach().clone(), requires_grad=m.requires_grad)
                        for m in masters if m is not None], opt_specs))
                except Exception as exc:
                    ref_error = exc
            try:
                model, params, wrapped = _resume_main_params(case, layout, fulls, model, wrapped)
            except Exception as exc:
                ours_error = exc
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
                for leaf in ref:
                    leaf.step()
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
    ref_state = {id(m): st for leaf in ref for m, st in leaf.state.items()}
    for i, (p, m, s, f) in enumerate(zip(params, masters, specs, fulls)):
        name = f"param {s['name']} ({s['dtype']} {s['shape']})"
        if m is None:
            _compare(f"{name} (not in the optimizer)", p, layout.make_local(f, s, "contiguous"))
            continue
        _compare(name, p, _local(m).detach().to(f.dtype))
        _compare(f"{name} main param", wrapped.main_param(p), _local(m).detach())
        expected_state = ref_state.get(id(m), {})
        ours = dict(wrapped.state[p]) if p in wrapped.state else {}
        ours.pop("main_param", None)
        if sorted(ours) != sorted(expected_state):
            raise Mismatch(f"{name}: state keys {sorted(ours)}, the reference's {sorted(expected_state)}")
        for key, value in expected_state.items():
            if torch.is_tensor(value):
                _compare(f"{name} {key}", ours[key], _local(value))
            elif ours[key] != value:
                raise Mismatch(f"{name} {key}: {ours[key]!r}, the reference's {value!r}")


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
    meshes = {tuple(shape): init_device_mesh("cpu", tuple(shape)) for shape in MESH_SHAPES}
    layout = Layout(meshes, workdir=os.path.dirname(cases_file))
    return [check_case(case, layout) for case in cases]
