"""Rank-side code of tests/test_compiled_optimizers.py: our optimizers' steps under ``torch.compile``
next to torch's counterpart compiled the same way (docs/performance.md#compiled-steps).

Each case builds the candidate and its reference from the same seed, steps each ``STEPS`` times through
``torch.compile`` (``torch._dynamo.reset()`` between them, so each has its own caches) and returns, per
run, the final tensors (params, states; DTensors as their full tensors), the graph breaks (reason
headline -> count) and whether a recompile happened after the warm-up steps
(``torch._dynamo.config.error_on_recompile`` is on from step ``WARM`` on). World size 1 runs plain
tensors; world size 2 runs ``Shard(0)`` DTensors whose shards are uneven (5 and 7 rows on 2 ranks).
"""
from __future__ import annotations

import functools
import logging
import re

import torch
import torch.nn.functional as F
from torch import nn

from npu_fsdp_patches.optim import FusedAdam, MainParamsOptimizer, apply_model_init_dtype
from npu_fsdp_patches.optim.foreach_adamw import foreach_adamw_step
from npu_fsdp_patches.optim.muon_routing import build_muon_adamw, split_muon_adamw_params

STEPS = 3
#: steps 0 and 1 may compile (state creation); from step WARM on a recompile raises
WARM = 2
SHAPES = [(5, 3), (7,), (3, 4), (1, 2)]
ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


# ----------------------------------------------------------------------------- helpers

@functools.lru_cache(maxsize=None)
def _mesh(world):
    """One mesh per process for all cases: torch's sharding-propagation cache hands out output specs that
    hold the first of several equal meshes, which ``apply_model_init_dtype``'s layout check (mesh
    identity) reports as a changed layout."""
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (world,)) if world > 1 else None


def _place(full: torch.Tensor, mesh):
    """``full`` as a Shard(0) DTensor on ``mesh`` (the same values on every rank), or itself."""
    if mesh is None:
        return full
    from torch.distributed.tensor import Shard, distribute_tensor
    return distribute_tensor(full, mesh, [Shard(0)])


def _params(mesh, dtype):
    g = torch.Generator().manual_seed(0)
    return [nn.Parameter(_place(torch.randn(s, generator=g).to(dtype), mesh)) for s in SHAPES]


def _set_grads(params, step, mesh):
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = _place(torch.randn(p.shape, generator=g).to(p.dtype), mesh)


def _full(t):
    from torch.distributed.tensor import DTensor
    t = t.detach()
    return t.full_tensor() if isinstance(t, DTensor) else t.clone()


def _headline(reason: str) -> str:
    return reason.strip().splitlines()[0]


class _BreakSites(logging.Handler):
    """Collect the user-code location of every graph break dynamo reports (its ``graph_breaks`` log), as
    ``"path/inside/site-packages:line"``: one site per place the compiled step leaves the graph, however
    often dynamo re-traces it (its counters count each trace, restarts included)."""

    LOGGER = "torch._dynamo.symbolic_convert.__graph_breaks"

    def __init__(self):
        super().__init__()
        self.sites = set()

    def emit(self, record):
        match = re.search(r"in user code at (\S+):(\d+)", record.getMessage())
        if match:
            path = match.group(1).replace("\\", "/")
            path = path.split("site-packages/")[-1].split("/npu_fsdp_patches/")[-1]
            self.sites.add(f"{path}:{match.group(2)}")

    def __enter__(self):
        torch._logging.set_logs(graph_breaks=True)
        self.logger = logging.getLogger(self.LOGGER)
        self.logger.addHandler(self)
        self.logger.propagate = False   # keep the log itself off stderr
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self)
        torch._logging.set_logs()


def _compiled_run(build, set_grads, backend):
    """Build (step callable, tensors-to-return callable), step it compiled, report."""
    import torch._dynamo
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    step, result = build()
    compiled = torch.compile(step, backend=backend)
    recompiled = None
    per_step = []
    with _BreakSites() as sites:
        try:
            for i in range(STEPS):
                per_step.append(set(sites.sites))
                sites.sites.clear()
                set_grads(i)
                torch._dynamo.config.error_on_recompile = i >= WARM
                try:
                    compiled()
                except torch._dynamo.exc.RecompileError as exc:
                    recompiled = f"step {i}: {exc}"[:400]
                    torch._dynamo.config.error_on_recompile = False
                    compiled()
        finally:
            torch._dynamo.config.error_on_recompile = False
    per_step = [sorted(s) for s in per_step[1:] + [set(sites.sites)]]   # the sites each step traced
    return {"tensors": [_full(t) for t in result()], "sites": sorted(set().union(*per_step)), "step_sites": per_step,
            "breaks": _breaks(counters), "recompiled": recompiled}


def _breaks(counters) -> dict:
    """Graph breaks dynamo counted, by reason headline (each trace counts, restarts included)."""
    breaks = {}
    for reason, n in counters["graph_break"].items():
        breaks[_headline(reason)] = breaks.get(_headline(reason), 0) + n
    return breaks


def _eager_run(build, set_grads):
    step, result = build()
    for i in range(STEPS):
        set_grads(i)
        step()
    return {"tensors": [_full(t) for t in result()]}


def _adam_tensors(params, opt, keys=("exp_avg", "exp_avg_sq")):
    return lambda: list(params) + [opt.state[p][k] for p in params for k in keys]


# ----------------------------------------------------------------------------- foreach_adamw_step

def foreach_case(rank, world, backend="aot_eager", dtype="float32", eager=False):
    """compiled ``foreach_adamw_step`` vs compiled ``AdamW(foreach=True).step``."""
    mesh, dt = _mesh(world), getattr(torch, dtype)
    holder = {}

    def build(ours):
        def make():
            params = _params(mesh, dt)
            opt = torch.optim.AdamW(params, foreach=True, **ADAMW)
            holder["params"] = params
            step = (lambda: foreach_adamw_step(opt)) if ours else opt.step
            return step, _adam_tensors(params, opt, ("exp_avg", "exp_avg_sq", "step"))
        return make

    grads = lambda i: _set_grads(holder["params"], i, mesh)
    out = {"ours": _compiled_run(build(True), grads, backend),
           "torch": _compiled_run(build(False), grads, backend)}
    if eager:
        out["eager"] = _eager_run(build(True), grads)
    return out


# ----------------------------------------------------------------------------- FusedAdam

def fused_case(rank, world, backend="aot_eager"):
    """compiled ``FusedAdam`` vs compiled ``AdamW(fused=True)`` (fp32), and compiled vs eager ``FusedAdam``
    with bf16 params and fp32 master weights (plain tensors: the low-precision path)."""
    mesh = _mesh(world)
    holder = {}

    def build(kind):
        def make():
            dtype = torch.bfloat16 if kind == "ours_bf16" else torch.float32
            params = _params(mesh if kind != "ours_bf16" else None, dtype)
            holder["params"], holder["mesh"] = params, mesh if kind != "ours_bf16" else None
            if kind == "torch":
                opt = torch.optim.AdamW(params, fused=True, **ADAMW)
            else:
                opt = FusedAdam(params, master_weights=kind == "ours_bf16", **ADAMW)
            keys = ("exp_avg", "exp_avg_sq") + (("master_param",) if kind == "ours_bf16" else ())
            return opt.step, _adam_tensors(params, opt, keys)
        return make

    grads = lambda i: _set_grads(holder["params"], i, holder["mesh"])
    out = {"ours": _compiled_run(build("ours"), grads, backend),
           "torch": _compiled_run(build("torch"), grads, backend)}
    if world == 1:
        out["ours_bf16"] = _compiled_run(build("ours_bf16"), grads, backend)
        out["ours_bf16_eager"] = _eager_run(build("ours_bf16"), grads)
    return out


# ----------------------------------------------------------------------------- MainParamsOptimizer

class _Net(nn.Module):
    """Row counts 5, 7 and 1 over 2 ranks: uneven shards and one empty shard under fully_shard."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 5, bias=False)
        self.b = nn.Linear(5, 7)
        self.gain = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))) * self.gain


def _model(world, mesh, reduce_dtype):
    torch.manual_seed(0)
    model = _Net()
    if mesh is not None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
        fully_shard(model.b, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
    return apply_model_init_dtype(model, torch.bfloat16)


MUON = dict(lr=0.02, weight_decay=0.0, momentum=0.95, nesterov=True, ns_steps=5)


class _Fp32MasterReference:
    """The reference for a main-params step: torch's optimizers (AdamW, or Muon for the matrices and
    AdamW for the rest, by the same routing rule) on fp32 copies of the bf16 params, grads cast to fp32,
    results copied back; written with torch's own (DTensor) ops only."""

    def __init__(self, model, muon, leaf_factory=None):
        self.params = list(model.parameters())
        self.masters = [nn.Parameter(p.detach().float()) for p in self.params]
        master_of = {id(p): m for p, m in zip(self.params, self.masters)}
        if muon:
            to_muon, to_adamw = split_muon_adamw_params(model.named_parameters())
            self.opts = [torch.optim.AdamW([master_of[id(p)] for p in to_adamw], foreach=True, **ADAMW),
                         torch.optim.Muon([master_of[id(p)] for p in to_muon], **MUON)]
        else:
            self.opts = [leaf_factory(self.masters) if leaf_factory
                         else torch.optim.AdamW(self.masters, foreach=True, **ADAMW)]

    @torch.no_grad()
    def step(self):
        for p, m in zip(self.params, self.masters):
            grad = getattr(p, "main_grad", None)   # as the wrapper: an fp32 main_grad first, else grad
            m.grad = (p.grad if grad is None else grad).float()
            p.grad = None
        for opt in self.opts:
            opt.step()
        for p, m in zip(self.params, self.masters):
            p.copy_(m)

    def states(self):
        return [_state_tensors(opt.state[m]) for m in self.masters for opt in self.opts if m in opt.state]


def _state_tensors(state: dict) -> list:
    return [v for k, v in sorted(state.items()) if isinstance(v, torch.Tensor) and k != "main_param"]


def _leaf_factory(leaf, lr_tensor, groups):
    """``params -> torch optimizer`` for ``leaf`` (``[class name, kwargs]``): with ``lr_tensor`` every lr a
    0-dim tensor (torch's way to change the lr without recompiling); ``groups``: per-group overrides, group i
    holding the i-th param and the last one the rest."""
    def make(params):
        params = list(params)
        kwargs = dict(leaf[1])
        lr = (lambda value: torch.tensor(value)) if lr_tensor else (lambda value: value)
        if "lr" in kwargs:
            kwargs["lr"] = lr(kwargs["lr"])
        if not groups:
            return getattr(torch.optim, leaf[0])(params, **kwargs)
        split = [{"params": [p], **{k: (lr(v) if k == "lr" else v) for k, v in g.items()}}
                 for p, g in zip(params, groups)]
        split[-1]["params"] = params[len(groups) - 1:]
        return getattr(torch.optim, leaf[0])(split, **kwargs)
    return make


def _decay_lr(groups, factor):
    """An LR schedule step: a tensor lr changes in place (no recompile), a float lr is replaced."""
    for group in groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].mul_(factor)
        else:
            group["lr"] *= factor


def _write(model, how, snapshot):
    """A write to the model between steps (issue 42): weight clipping or a rewind to ``snapshot``."""
    if how == "rewind":
        model.load_state_dict(snapshot)
        return
    with torch.no_grad():
        for p in model.parameters():
            p.clamp_(-0.05, 0.05)


@torch.no_grad()
def _rederive(masters, params):
    """The reference's side of a model write: each fp32 master takes the model's value where the model param no
    longer equals the master rounded (bit for bit), as MainParamsOptimizer does (docs/main_params.md)."""
    from npu_fsdp_patches.optim.tensors import local_tensor
    for m, p in zip(masters, params):
        m_l, p_l = local_tensor(m), local_tensor(p)
        same = m_l.to(p_l.dtype).view(torch.int16) == p_l.view(torch.int16)
        m_l.copy_(torch.where(same, m_l, p_l.float()))


def main_params_case(rank, world, backend="aot_eager", reduce="bfloat16", eager=False, muon=False,
                     leaf=None, lr_tensor=False, groups=None, main_grad=False, keep_grads=False, write=None):
    """compiled ``MainParamsOptimizer`` over AdamW (or Muon + AdamW) vs a compiled fp32-master reference;
    world 2 is ``fully_shard`` with ``reduce_dtype`` bf16 (the grad cast path) or fp32. ``leaf``: ``[class
    name, kwargs]`` of another torch optimizer for both (e.g. Adam with amsgrad). ``lr_tensor``: every lr a
    tensor, decayed in place before each step after the first; ``groups``: several param groups (see
    ``_leaf_factory``); ``main_grad``: the grads accumulated into fp32 ``main_grad`` attributes, as hyper and
    Megatron write them; ``keep_grads``: ``zero_grad(set_to_none=False)`` between steps (the reference zeroes
    the same tensors in place); ``write``: before the second step the model is written (``"clamp"``: weight
    clipping in place, ``"rewind"``: ``load_state_dict`` of its initial values), the reference's fp32 masters
    re-derived from it by the documented rule."""
    if lr_tensor or groups:   # a tensor lr with foreach needs capturable=True (torch's recipe)
        leaf = leaf or ["AdamW", {**ADAMW, "foreach": True, "capturable": lr_tensor}]
    leaf_factory = _leaf_factory(leaf, lr_tensor, groups) if leaf else None
    mesh = _mesh(world)
    holder = {}

    def build(ours):
        def make():
            model = _model(world, mesh, getattr(torch, reduce))
            holder["model"], holder["ref"] = model, None
            holder["snapshot"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
            if ours:
                leaf = (build_muon_adamw(model, muon_kwargs=MUON, adamw_kwargs={**ADAMW, "foreach": True})
                        if muon else leaf_factory(model.parameters()) if leaf_factory
                        else torch.optim.AdamW(model.parameters(), foreach=True, **ADAMW))
                opt = MainParamsOptimizer(leaf, model)
                holder["groups"], holder["zero_grad"] = opt.param_groups, opt.zero_grad
                mains = [opt.main_param(p) for p in model.parameters()]
                return opt.step, lambda: list(model.parameters()) + mains + [
                    t for p in model.parameters() for t in _state_tensors(opt.state[p])]
            ref = _Fp32MasterReference(model, muon, leaf_factory)
            holder["ref"] = ref
            holder["groups"] = [g for opt in ref.opts for g in opt.param_groups]
            holder["zero_grad"] = lambda set_to_none: [getattr(p, name).zero_() for p in model.parameters()
                                                       for name in ("grad", "main_grad")
                                                       if getattr(p, name, None) is not None]
            return ref.step, lambda: list(model.parameters()) + ref.masters + [
                t for ts in ref.states() for t in ts]
        return make

    def grads(i):
        model = holder["model"]
        if write and i == 1:
            _write(model, write, holder["snapshot"])
            if holder["ref"] is not None:
                _rederive(holder["ref"].masters, holder["ref"].params)
        if i and keep_grads:
            holder["zero_grad"](set_to_none=False)
        if i and lr_tensor:
            _decay_lr(holder["groups"], 0.9)
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(200 + i)).to(torch.bfloat16)
        x = x[rank * 3:(rank + 1) * 3] if world > 1 else x
        F.mse_loss(model(x).float(), torch.zeros(x.shape[0], 7)).backward()
        if main_grad:   # accumulated into a persistent fp32 main_grad, the model grad released
            with torch.no_grad():
                for p in model.parameters():
                    if getattr(p, "main_grad", None) is None:
                        p.main_grad = p.grad.float()
                    else:
                        p.main_grad.add_(p.grad)
                    p.grad = None

    out = {"ours": _compiled_run(build(True), grads, backend),
           "torch": _compiled_run(build(False), grads, backend)}
    if eager:
        out["eager"] = _eager_run(build(True), grads)
    return out


def suite(rank, world, cases):
    """Run several ``[name, kwargs]`` cases in one launch (one interpreter per rank for all of them)."""
    return {f"{name}:{','.join(f'{k}={v}' for k, v in sorted(kwargs.items()))}":
            globals()[name](rank, world, **kwargs) for name, kwargs in cases}


def main_params_fusion_case(rank, world, hooked=False):
    """What a compiled ``MainParamsOptimizer.step`` over one torch AdamW traces, step by step: the graphs
    dynamo hands the backend (the call targets in each), whether the main params keep a grad after the step
    and how often a step pre-hook on the leaf fired (``hooked``: the leaf's step must then run as itself)."""
    mesh = _mesh(world)
    model = _model(world, mesh, torch.bfloat16)
    opt = MainParamsOptimizer(torch.optim.AdamW(model.parameters(), foreach=True, **ADAMW), model)
    fired = []
    if hooked:
        opt.optimizer.register_step_pre_hook(lambda *args: fired.append(1))
    compiled = []

    def backend(gm, example_inputs):
        compiled.append(sorted({n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
                                for n in gm.graph.nodes if n.op in ("call_function", "call_method")}))
        return gm.forward

    torch._dynamo.reset()
    step = torch.compile(opt.step, backend=backend)
    graphs, main_grads = [], []
    for i in range(STEPS):
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(300 + i)).to(torch.bfloat16)
        x = x[rank * 3:(rank + 1) * 3] if world > 1 else x
        F.mse_loss(model(x).float(), torch.zeros(x.shape[0], 7)).backward()
        before = len(compiled)
        step()
        graphs.append(compiled[before:])
        main_grads.append([opt.main_param(p).grad is not None for p in model.parameters()])
        opt.zero_grad()
    torch._dynamo.reset()
    return {"graphs": graphs, "main_grads": main_grads, "fired": len(fired)}
