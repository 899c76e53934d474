"""Megatron-FSDP's real call shapes through TE's real FusedAdam (a registry wheel's source, te_real.py).

Everything is built as Megatron-Core core_v0.18.0 builds it (paths under megatron/core/):

* params: ``make_fsdp_dtensor`` (distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py:4588-4747):
  ``nn.Parameter(DTensor.from_local(local.view(-1, *shape[1:]), mesh, placements, run_check=False,
  shape=global, stride=...))`` (L4731-4738). A TP-sharded param sits on ``[Shard(0), tp]``, HSDP
  ``[Shard(0), Shard(0), tp]`` or ``[Replicate(), Shard(0), tp]`` (``_get_fsdp_tensor_spec`` L4512-4558;
  here ``tp`` is ``Replicate()`` or ``Shard(d)``, a size-1 tp dim as L4677-4680 asks when TP=1); a
  TP-duplicated (1-D) param sits on the dp-only submesh (L4560-4578). Local rows are the param's rows
  in one flat bucket cut into equal row-aligned pieces per FSDP shard, so shards are uneven and empty.
* grads: one DTensor per param made on the first step, whose ``_local_tensor`` is swapped every step
  (``update_main_grads`` L2970-2986); ``None`` on an empty local shard (L2988-2989); with decoupled
  grads it is ``param.decoupled_grad``, uncast (L2964-2967, L2993-2997); after the step every grad is
  dropped (``copy_main_weights_to_model_weights`` L2794-2802).
* the optimizer: TE FusedAdam with optimizer/__init__.py:544-586's kwargs (precision-aware:
  ``master_weights=True, use_decoupled_grad=True``), then ``master_weights = False`` and
  ``use_decoupled_grad = True`` set on the built object (optimizer/__init__.py:1078-1089).
* resume (``fsdp_dtensor``): ``_init_optimizer_states_with_dummy_values`` (optimizer/
  distrib_optimizer.py:1366-1379: ``param.grad = zeros_like`` on non-empty shards only, ``step()``,
  ``zero_grad()``), then ``{"state": {name: optimizer.state[param]}}`` is the template DCP loads into in
  place (distrib_optimizer.py:1577-1599, training/checkpointing.py:1407-1430), then
  ``optimizer.load_state_dict`` with the groups rebuilt from ``param_to_group_meta`` (L868-879).

Every run compares each rank's local shards with a float64 AdamW on the same elements (AdamW is
elementwise, so no collective is needed and none is issued after the meshes are built).
"""
from __future__ import annotations

import importlib
import traceback
from typing import NamedTuple

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import npu_fsdp_patches
from tests.support import Checks, bit_mismatches

LR, WD, BETAS, EPS = 5e-2, 0.1, (0.9, 0.999), 1e-8
STEPS, RESUME_AT = 4, 2
# name -> global shape; 2-D params are TP-sharded, 1-D ones TP-duplicated; "tail" is last in the bucket
PARAMS = (("w", (6, 4)), ("b", (5,)), ("tail", (4, 2)))
DIM_NAMES = {2: ("dp_shard", "tp"), 3: ("dp_outer", "dp_shard", "tp")}
MESHES = {  # world -> (layout, mesh shape); each runs with tp = Replicate(), Shard(0), Shard(1)
    2: (("fsdp", (2, 1)), ("fsdp", (1, 2)), ("hsdp_outer_shard", (2, 1, 1)),
        ("hsdp_outer_shard", (1, 1, 2)), ("hsdp", (1, 2, 1)), ("hsdp", (2, 1, 1))),
    4: (("fsdp", (2, 2)), ("fsdp", (4, 1)), ("hsdp_outer_shard", (2, 2, 1)),
        ("hsdp_outer_shard", (2, 1, 2)), ("hsdp", (2, 2, 1)), ("hsdp", (2, 1, 2))),
}
TPS = {"R": Replicate(), "S0": Shard(0), "S1": Shard(1)}


class Config(NamedTuple):
    param: torch.dtype
    grad: torch.dtype
    moments: torch.dtype
    precision_aware: bool    # decoupled grads + the flag flip; else grads in .grad, cast to the param


CONFIGS = {
    "fp32": Config(torch.float32, torch.float32, torch.float32, True),
    # main grads in the model's bf16 (main_grads_dtype auto), fp16 moments: _apply_scale on empties
    "bf16grad_fp16m": Config(torch.float32, torch.bfloat16, torch.float16, True),
    # --megatron-fsdp-main-params-dtype bf16: TE's step calls initialize_state(p, True) after the flip
    "bf16param_bf16m": Config(torch.bfloat16, torch.float32, torch.bfloat16, True),
    "grad_fp32": Config(torch.float32, torch.float32, torch.float32, False),
}
_TOL = {"fp32": 1e-6, "bf16grad_fp16m": 1e-4, "grad_fp32": 1e-6}   # bf16 params: 2 bf16 ulp


def _placements(layout: str, tp) -> list:
    return {"fsdp": [Shard(0)], "hsdp_outer_shard": [Shard(0), Shard(0)],
            "hsdp": [Replicate(), Shard(0)]}[layout] + [tp]


def _fsdp_shard(layout: str, shape, coord) -> tuple:
    """(this rank's FSDP shard index, shard count) over the Shard(0) dims."""
    if layout == "fsdp":
        return coord[0], shape[0]
    if layout == "hsdp_outer_shard":
        return coord[0] * shape[1] + coord[1], shape[0] * shape[1]
    return coord[1], shape[1]


def _fulls(dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for n, s in PARAMS}


class Layout:
    """One mesh + tp placement, and how each param's global tensor maps to this rank's local rows."""

    def __init__(self, layout: str, mesh, tp):
        self.name, self.mesh, self.tp = layout, mesh, tp
        shape, coord = tuple(mesh.shape), mesh.get_coordinate()
        self.dp_mesh = mesh[DIM_NAMES[len(shape)][:-1]]
        self.tp_size, self.tp_coord = shape[-1], coord[-1]
        shard, shards = _fsdp_shard(layout, shape, coord)
        tp_locals = {n: self._tp_local(torch.empty(s)) for n, s in PARAMS}
        self.rows = _row_ranges(tp_locals, shards, shard)

    def _tp_local(self, full):
        if full.dim() > 1 and isinstance(self.tp, Shard):
            return full.chunk(self.tp_size, dim=self.tp.dim)[self.tp_coord]
        return full

    def spec(self, name: str, full):
        """(mesh, placements) of a param: TP-sharded on the whole mesh, TP-duplicated on the dp mesh."""
        if full.dim() > 1:
            return self.mesh, _placements(self.name, self.tp)
        return self.dp_mesh, _placements(self.name, self.tp)[:-1]

    def local(self, name: str, full):
        """This rank's rows, shaped ``(-1, *tp_local_shape[1:])`` as make_fsdp_dtensor views them (L4724-4729)."""
        start, end = self.rows[name]
        return self._tp_local(full)[start:end].clone()

    def dtensor(self, name: str, full, local=None):
        """``make_fsdp_dtensor``'s final from_local (param_and_grad_buffer.py:4731-4738)."""
        mesh, placements = self.spec(name, full)
        local = self.local(name, full) if local is None else local
        return DTensor.from_local(local, mesh, placements, run_check=False,
                                  shape=full.shape, stride=torch.empty(full.shape).stride())


def _row_ranges(tp_locals: dict, shards: int, shard: int) -> dict:
    """Rows of each param in shard ``shard`` of one flat bucket cut into ``shards`` equal pieces."""
    total = sum(t.numel() for t in tp_locals.values())
    piece, offset, out = -(-total // shards), 0, {}
    for name, t in tp_locals.items():
        row = t[0].numel() if t.dim() > 1 else 1
        mine = [r for r in range(t.shape[0]) if min((offset + r * row) // piece, shards - 1) == shard]
        out[name] = (mine[0], mine[-1] + 1) if mine else (0, 0)
        offset += t.numel()
    return out


def _grads(step: int, dtype) -> dict:
    return _fulls(dtype, 100 + step)


class Model:
    """Params, grads and the optimizer of one run, built as Megatron-FSDP builds them."""

    def __init__(self, cls, layout: Layout, config: Config, flip: bool = True):
        self.layout, self.config = layout, config
        self.fulls = _fulls(config.param, 1)
        self.params = {n: torch.nn.Parameter(layout.dtensor(n, f)) for n, f in self.fulls.items()}
        self.grads: dict = {}
        kw = dict(lr=LR, weight_decay=WD, betas=BETAS, eps=EPS, capturable=False, adam_w_mode=True)
        if config.precision_aware:  # optimizer/__init__.py:562-584
            kw.update(exp_avg_dtype=config.moments, exp_avg_sq_dtype=config.moments, master_weights=True,
                      use_decoupled_grad=True, master_weight_dtype=torch.float32,
                      store_param_remainders=True)
        group = {"params": list(self.params.values()), "wd_mult": 1.0, "lr_mult": 1.0,
                 "is_expert_parallel": False, "is_decoupled_lr": False}
        self.opt = cls([group], **kw)
        if config.precision_aware and flip:  # optimizer/__init__.py:1087-1089, after construction
            self.opt.master_weights = False
            self.opt.use_decoupled_grad = True

    def set_grads(self, step: int) -> None:
        """``update_main_grads``: swap each grad DTensor's local tensor; None on an empty shard."""
        decoupled = self.config.precision_aware
        for name, full in _grads(step, self.config.grad).items():
            p = self.params[name]
            local = self.layout.local(name, full)
            if not decoupled:
                local = local.to(self.config.param)   # L2964-2967: cast unless decoupled
            if name not in self.grads:
                self.grads[name] = self.layout.dtensor(name, full, local)
            else:
                self.grads[name]._local_tensor = local
            grad = self.grads[name] if local.numel() else None
            setattr(p, "decoupled_grad" if decoupled else "grad", grad)

    def drop_grads(self) -> None:
        """``copy_main_weights_to_model_weights`` (L2794-2802)."""
        for name, p in self.params.items():
            p.grad = None
            if hasattr(p, "decoupled_grad"):
                p.decoupled_grad = None
            if name in self.grads:
                self.grads[name]._local_tensor = None

    def train(self, steps) -> None:
        for step in steps:
            self.set_grads(step)
            self.opt.step()
            self.drop_grads()

    def locals(self) -> dict:
        return {n: p._local_tensor.detach().clone() for n, p in self.params.items()}

    def reference(self, name: str, steps: int) -> torch.Tensor:
        """float64 AdamW on this rank's elements; bf16 params and moments rounded after each step."""
        c = self.config
        p = self.layout.local(name, self.fulls[name]).double()
        m, v = torch.zeros_like(p), torch.zeros_like(p)
        rnd = (lambda x: x.to(torch.bfloat16).double()) if c.param == torch.bfloat16 else (lambda x: x)
        rnd_m = (lambda x: x.to(torch.bfloat16).double()) if c.moments == torch.bfloat16 else (lambda x: x)
        for t in range(1, steps + 1):
            g = self.layout.local(name, _grads(t - 1, c.grad)[name]).double()
            if not c.precision_aware:
                g = g.to(c.param).double()
            m, v = BETAS[0] * m + (1 - BETAS[0]) * g, BETAS[1] * v + (1 - BETAS[1]) * g * g
            upd = (m / (1 - BETAS[0] ** t)) / ((v / (1 - BETAS[1] ** t)).sqrt() + EPS)
            p, m, v = rnd(p * (1 - LR * WD) - LR * upd), rnd_m(m), rnd_m(v)
        return p


def max_error(model: Model, steps: int, config_name: str) -> float:
    """max |param - float64 AdamW| over this rank's shards, in units of the config's tolerance."""
    worst = 0.0
    for name, p in model.params.items():
        got, ref = p._local_tensor.detach().double(), model.reference(name, steps)
        if got.numel() == 0:
            continue
        tol = _TOL.get(config_name)
        if tol is None:  # bf16 params: 2 bf16 ulp of the value (at least of 0.25)
            tol = 2.0 ** -6 * ref.abs().clamp(min=0.25)
        worst = max(worst, float(((got - ref).abs() / tol).max()))
    return worst


def layout_problems(model: Model) -> list:
    """States that are not DTensors with their param's mesh, placements, shape, stride, local shape."""
    bad = []
    for name, p in model.params.items():
        state = model.opt.state[p]
        if set(state) != {"exp_avg", "exp_avg_sq"}:
            bad.append(f"{name}: states {sorted(state)}")
        for key, s in state.items():
            if not (isinstance(s, DTensor) and s.device_mesh == p.device_mesh and s.placements == p.placements
                    and s.shape == p.shape and s.stride() == p.stride()
                    and s._local_tensor.shape == p._local_tensor.shape):
                bad.append(f"{name}.{key}: {type(s).__name__} {getattr(s, 'placements', None)}")
    return bad


def resume(cls, layout: Layout, config: Config) -> dict:
    """Save after RESUME_AT steps, resume as fsdp_dtensor does, continue: vs the uninterrupted run."""
    a = Model(cls, layout, config)
    a.train(range(RESUME_AT))
    saved = {n: {k: v._local_tensor.clone() if isinstance(v, DTensor) else v for k, v in a.opt.state[p].items()}
             for n, p in a.params.items()}
    weights, meta = a.locals(), {k: v for k, v in a.opt.param_groups[0].items() if k != "params"}
    a.train(range(RESUME_AT, STEPS))
    b = Model(cls, layout, config)
    for p in b.params.values():  # _init_optimizer_states_with_dummy_values (distrib_optimizer.py:1366-1379)
        if p._local_tensor.numel():
            p.grad = torch.zeros_like(p)
    b.opt.step()
    b.opt.zero_grad()
    out = {"dummy_states": {n: sorted(b.opt.state[p]) for n, p in b.params.items()}}
    template = {n: b.opt.state[p] for n, p in b.params.items()}
    for name, state in template.items():  # DCP fills the template in place (allow_partial_load)
        for key, value in state.items():
            if key in saved[name] and isinstance(value, DTensor):
                value._local_tensor.copy_(saved[name][key])
        b.params[name]._local_tensor.detach().copy_(weights[name])
    out["not_in_template"] = sorted(f"{n}.{k}" for n in saved for k in saved[n] if k not in template[n])
    groups = [{"params": list(template), **meta}]   # _param2group_meta_to_param_groups
    b.opt.load_state_dict({"state": template, "param_groups": groups})
    out["empty_scales"] = [float(s) for p in b.params.values() if not p._local_tensor.numel()
                           for s in getattr(b.opt, "_scales", {}).get(p, {}).values()]
    b.train(range(RESUME_AT, STEPS))
    got, want = b.locals(), a.locals()
    out["mismatch"] = sorted(n for n in got if bit_mismatches(got[n], want[n])[0])
    out["max_diff"] = max((float((got[n].double() - want[n].double()).abs().max()) for n in got if got[n].numel()),
                          default=0.0)
    return out


class KernelSpy:
    """Records the smallest tensor each multi-tensor kernel call of TE's step receives."""

    def __init__(self):
        self.module = importlib.import_module("transformer_engine.pytorch.optimizers.fused_adam")
        self.original, self.smallest = self.module.multi_tensor_applier, []

        def spy(op, flag, lists, *args):
            self.smallest.append(min(t.numel() for t in lists[0]))
            return self.original(op, flag, lists, *args)
        self.module.multi_tensor_applier = spy

    def close(self) -> list:
        self.module.multi_tensor_applier = self.original
        return self.smallest


def run(cls, layout: Layout, name: str) -> dict:
    """Train, then resume; the error (if any) instead of the facts it stopped."""
    config = CONFIGS[name]
    out: dict = {"error": None}
    spy = KernelSpy()
    try:
        model = Model(cls, layout, config)
        model.train(range(STEPS))
        smallest = spy.close()
        out["kernel_smallest"] = min(smallest) if smallest else None   # None: TE's kernel never ran
        out["max_error"] = max_error(model, STEPS, name)
        out["layout_problems"] = layout_problems(model)
        out["resume"] = resume(cls, layout, config)
    except Exception as exc:  # reported: the pytest side knows what each release shows
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["where"] = traceback.format_exc(limit=-4)
    finally:
        spy.close()
    return out


def _layouts(world: int) -> dict:
    meshes = {}
    out = {}
    for layout, shape in MESHES[world]:
        if shape not in meshes:
            meshes[shape] = init_device_mesh("cpu", shape, mesh_dim_names=DIM_NAMES[len(shape)])
            meshes[shape][DIM_NAMES[len(shape)][:-1]]   # build the dp submesh on every rank now
        for tp_name, tp in TPS.items():
            out[f"{layout}{list(shape)}/tp={tp_name}"] = Layout(layout, meshes[shape], tp)
    return out


CHECKS = ("numerics_vs_float64", "state_layout", "flag_flip_read_at_step", "dummy_step_states_everywhere",
          "resume_continues_bitwise", "empty_shard_scales_stay_one")


def case(rank: int, world: int) -> dict:
    """Every layout x config with TE's own code (every patch reverted), then with the patches applied."""
    from transformer_engine.pytorch.optimizers import FusedAdam
    layouts = _layouts(world)
    status = {r["name"]: r["state"] for r in npu_fsdp_patches.status()}
    npu_fsdp_patches.revert()
    unpatched = {(lk, c): run(FusedAdam, lay, c) for lk, lay in layouts.items() for c in CONFIGS}
    npu_fsdp_patches.apply(*[n for n, s in status.items() if s == "applied"])
    patched = {(lk, c): run(FusedAdam, lay, c) for lk, lay in layouts.items() for c in CONFIGS}
    checks = Checks()
    _patched_checks(checks, FusedAdam, layouts, patched)
    return {"checks": checks.results, "status": status, "patched": patched, "unpatched": unpatched,
            "rows": {lk: lay.rows for lk, lay in layouts.items()}}


def _each(patched: dict, test) -> None:
    bad = []
    for (lk, c), r in patched.items():
        if r["error"]:
            bad.append(f"{lk} {c}: {r['error']}")
            continue
        why = test(c, r)
        if why:
            bad.append(f"{lk} {c}: {why}")
    assert not bad, bad[:6]


def _patched_checks(checks: Checks, cls, layouts: dict, patched: dict) -> None:
    checks.run("numerics_vs_float64", lambda: _each(
        patched, lambda c, r: r["max_error"] > 1 and f"{r['max_error']:.2f} x tolerance"))
    checks.run("state_layout", lambda: _each(patched, lambda c, r: r["layout_problems"]))
    checks.run("dummy_step_states_everywhere", lambda: _each(patched, lambda c, r: any(
        s != ["exp_avg", "exp_avg_sq"] for s in r["resume"]["dummy_states"].values())
        and r["resume"]["dummy_states"]))
    checks.run("resume_continues_bitwise", lambda: _each(patched, lambda c, r: (
        CONFIGS[c].moments != torch.float16 and (r["resume"]["mismatch"] or r["resume"]["not_in_template"]))))
    checks.run("empty_shard_scales_stay_one", lambda: _each(patched, lambda c, r: any(
        s != 1.0 for s in r["resume"]["empty_scales"]) and r["resume"]["empty_scales"]))

    @checks("flag_flip_read_at_step")
    def flag_flip():
        # the flipped optimizer keeps no master copy (patched numerics above match the params);
        # control: the same optimizer without the flip does, so the flag is what decides
        lay = next(iter(layouts.values()))
        for flip, want in ((True, {"exp_avg", "exp_avg_sq"}), (False, {"exp_avg", "exp_avg_sq", "master_param"})):
            model = Model(cls, lay, CONFIGS["fp32"], flip=flip)
            model.train(range(1))
            got = {k for p in model.params.values() for k in model.opt.state[p]}
            assert got == want, (flip, got)
