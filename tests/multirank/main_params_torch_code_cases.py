"""What ordinary torch training code does with a MainParamsOptimizer, next to an fp32-master reference (issue 42).

Shared by tests/test_main_params_grad_scaler.py (plain tensors, in process) and
tests/test_main_params_torch_code_two_ranks.py (``fully_shard`` on 2 gloo ranks, uneven and empty shards; one
launch for every check). The reference is torch's AdamW on fp32 copies of the low-precision params (the masters),
fed the model's grads cast to fp32 and copied back after each step, written with torch's own (DTensor) ops.

* Writes between steps: the reference's masters take the model's value where the written model param differs,
  bit for bit, from its master rounded (docs/main_params.md#contract-with-torch-code).
* ``torch.amp.GradScaler``: both run torch's recipe with scalers of the same settings, inf/NaN grads injected
  into some steps (on 2 ranks into rank 0's shard only). The scaler and the clip act on the grads the model
  params hold: for fp16 params fp32 grads (the wrapper widens them on torch >= 2.10, the reference casts them to
  its masters first), for bf16 and fp32 params the params' own grads, which torch unscales and clips in their
  dtype for any optimizer (docs/main_params.md#fp16-and-torchs-gradscaler).
"""
from __future__ import annotations

import copy
import types

import torch
import torch.nn.functional as F
from torch import nn

from npu_fsdp_patches.optim import MainParamsOptimizer, apply_model_init_dtype
from npu_fsdp_patches.optim._loss_scaling import WIDENS_FP16_GRADS
from npu_fsdp_patches.optim.tensors import local_tensor
from tests.multirank.compiled_optimizer_cases import _Net, _full, _rederive, _write
from tests.support import Checks, bit_mismatches

ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
CHECKS = ("write_rewind", "write_clamp", "checkpoint_reload_keeps_tails", "zero_grad_matches_plain",
          "amp_fp16_clip", "amp_fp16_short", "amp_bf16_clip", "amp_bf16_short", "amp_skip_leaves_everything",
          "amp_fp16_clip_refused_before_torch_2_10")


def build(dtype, mesh, seed=0):
    """``_Net`` (5, 7 and 1 rows: uneven and empty shards on 2 ranks) in ``dtype``, ``fully_shard`` on ``mesh``."""
    torch.manual_seed(seed)
    model = _Net()
    if mesh is not None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        fully_shard(model.b, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
    return apply_model_init_dtype(model, dtype)


def batch(i, rank, world, dtype):
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(200 + i)).to(dtype)
    return x[rank * 3:(rank + 1) * 3] if world > 1 else x


def loss_of(model, x):
    return F.mse_loss(model(x).float(), torch.ones(x.shape[0], 7))


class Reference:
    """torch's AdamW on fp32 masters of ``model``'s params; ``scaled_params`` are what GradScaler unscales."""

    def __init__(self, model, widen):
        self.params = list(model.parameters())
        self.masters = [nn.Parameter(p.detach().float()) for p in self.params]
        self.opt = torch.optim.AdamW(self.masters, **ADAMW)
        self.widen = widen   # the scaler sees fp32 grads (the masters'), as the wrapper's widened fp16 params
        if widen and WIDENS_FP16_GRADS:   # as the wrapper's fp16 params: torch >= 2.15's FSDP2 then keeps the
            for p in self.params:         # reduce-scatter's fp32 output as the grad instead of rounding it to fp16
                p.grad_dtype = None

    @property
    def param_groups(self):   # what GradScaler.unscale_ walks
        return [{"params": self.masters if self.widen else self.params}]

    @torch.no_grad()
    def cast_grads(self):
        for p, m in zip(self.params, self.masters):
            if p.grad is not None:
                m.grad = p.grad.float()
                p.grad = None

    @torch.no_grad()
    def step(self):
        self.cast_grads()
        self.opt.step()
        for p, m in zip(self.params, self.masters):
            local_tensor(p).copy_(local_tensor(m))

    def zero_grad(self):
        self.opt.zero_grad()
        for p in self.params:
            p.grad = None

    def tensors(self):
        return self.params + self.masters + [self.opt.state[m][k] for m in self.masters for k in ("exp_avg", "exp_avg_sq",
                                                                                                   "step")]


def wrapper_tensors(model, opt):
    params = list(model.parameters())
    return params + [opt.main_param(p) for p in params] + [opt.state[p][k] for p in params
                                                           for k in ("exp_avg", "exp_avg_sq", "step")]


def mismatches(a, b):
    """``[(index, count, first)]`` of the tensors whose bits differ (full tensors: a collective on 2 ranks)."""
    out = []
    for i, (x, y) in enumerate(zip(a, b)):
        n, first = bit_mismatches(x, y)
        if n:
            out.append((i, n, first))
    return out


def _poison(model, value, rank):
    """Write ``value`` into the first element of rank 0's first non-empty local grad shard."""
    if rank:
        return
    for p in model.parameters():
        local = local_tensor(p.grad)
        if local.numel():
            with torch.no_grad():
                local.view(-1)[0] = value
            return


def amp_run(dtype, clip, rank=0, world=1, mesh=None, steps=6, poisoned=None, watch=None):
    """The AMP recipe (``clip``: unscale_, clip_grad_norm_, step, update; else the short form) on the wrapper
    and on the reference. ``poisoned``: {step: inf or nan}; ``watch``: a step whose skip is checked (everything
    of the wrapper bit-identical across ``scaler.step``). Returns the mismatches, the scales, the skip check."""
    poisoned = {2: float("inf"), 4: float("nan")} if poisoned is None else poisoned
    model, ref_model = build(dtype, mesh), build(dtype, mesh)
    opt = MainParamsOptimizer(torch.optim.AdamW(model.parameters(), **ADAMW), model)
    ref = Reference(ref_model, widen=dtype == torch.float16)
    scaler, ref_scaler = (torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=2) for _ in range(2))
    scales, skip = [], None
    for i in range(steps):
        x = batch(i, rank, world, dtype)
        for m, s in ((model, scaler), (ref_model, ref_scaler)):
            s.scale(loss_of(m, x)).backward()
            if i in poisoned:
                _poison(m, poisoned[i], rank)
        if ref.widen:
            ref.cast_grads()
        if clip:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            ref_scaler.unscale_(ref)
            torch.nn.utils.clip_grad_norm_([p for g in ref.param_groups for p in g["params"]], 0.05)
        before = [_full(t) for t in wrapper_tensors(model, opt)] if i == watch else None
        scaler.step(opt)
        ref_scaler.step(ref)
        if before is not None:
            skip = mismatches(before, wrapper_tensors(model, opt))
        scaler.update()
        ref_scaler.update()
        scales.append((scaler.get_scale(), ref_scaler.get_scale()))
        opt.zero_grad()
        ref.zero_grad()
    return {"mismatches": mismatches(wrapper_tensors(model, opt), ref.tensors()), "scales": scales, "skip": skip,
            "steps": int(opt.state[next(iter(model.parameters()))]["step"])}


def writes_run(how, rank=0, world=1, mesh=None, dtype=torch.bfloat16):
    """Two steps, a write (rewind to the initial values, or clamp), two more steps; wrapper vs reference."""
    model, ref_model = build(dtype, mesh), build(dtype, mesh)
    snapshot = copy.deepcopy(model.state_dict())
    opt = MainParamsOptimizer(torch.optim.AdamW(model.parameters(), **ADAMW), model)
    ref = Reference(ref_model, widen=False)
    for i in range(4):
        if i == 2:
            _write(model, how, snapshot)
            _write(ref_model, how, snapshot)
            _rederive(ref.masters, ref.params)
        x = batch(i, rank, world, dtype)
        for m, o in ((model, opt), (ref_model, ref)):
            loss_of(m, x).backward()
            o.step()
            o.zero_grad()
    return mismatches(wrapper_tensors(model, opt), ref.tensors())


def reload_run(order, rank=0, world=1, mesh=None, dtype=torch.bfloat16):
    """A checkpoint of model and wrapper taken after step 2, two more steps, both reloaded (``order``), two more
    steps: bit-identical to the run that went on from the checkpoint."""
    model = build(dtype, mesh)
    opt = MainParamsOptimizer(torch.optim.AdamW(model.parameters(), **ADAMW), model)
    twin_model = build(dtype, mesh)
    twin = MainParamsOptimizer(torch.optim.AdamW(twin_model.parameters(), **ADAMW), twin_model)

    def step(m, o, i):
        loss_of(m, batch(i, rank, world, dtype)).backward()
        o.step()
        o.zero_grad()

    for i in range(2):
        step(model, opt, i)
        step(twin_model, twin, i)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    for i in range(2, 4):
        step(model, opt, i)
    loads = [lambda: model.load_state_dict(saved_model), lambda: opt.load_state_dict(saved_opt)]
    for load in loads if order == "model first" else loads[::-1]:
        load()
    for i in range(2, 4):
        step(model, opt, i)
        step(twin_model, twin, i)
    return mismatches(wrapper_tensors(model, opt), wrapper_tensors(twin_model, twin))


class MixNet(nn.Module):
    """A bf16, an fp16 and an fp32 layer, and an unused param (it never gets a grad)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 5).to(torch.bfloat16)
        self.b = nn.Linear(5, 7).to(torch.float16)
        self.c = nn.Linear(7, 7)
        self.unused = nn.Parameter(torch.ones(3, dtype=torch.bfloat16))

    def forward(self, x):
        return self.c(self.b(torch.tanh(self.a(x.to(torch.bfloat16))).to(torch.float16)).float())


def zero_grad_run(set_to_none, rank=0, world=1, mesh=None):
    """A model stepped once, then ``zero_grad(set_to_none)``: each model param's grad as a plain AdamW over the
    same model leaves it (None, or zeros; an fp16 param's zeros are fp32 where the wrapper widens its grads), and
    no main param keeps a grad. Plain tensors: a bf16 / fp16 / fp32 mix; 2 ranks: the bf16 ``fully_shard`` model."""
    out = {}
    for wrapped in (True, False):
        model = MixNet() if mesh is None else build(torch.bfloat16, mesh)
        opt = torch.optim.AdamW(model.parameters(), **ADAMW)
        opt = MainParamsOptimizer(opt, model) if wrapped else opt
        loss_of(model, batch(0, rank, world, torch.float32 if mesh is None else torch.bfloat16)).backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        grads = {}
        for name, p in model.named_parameters():
            g = p.grad
            grads[name] = None if g is None else (str(g.dtype), type(g).__name__, bool(local_tensor(g).eq(0).all()),
                                                   g.requires_grad)
        mains = ([opt.main_param(p).grad is None for p in model.parameters() if p.dtype != torch.float32]
                 if wrapped else [])
        out["wrapped" if wrapped else "plain"] = {"grads": grads, "mains_without_grad": all(mains)}
    return out


def widened(name: str, dtype_name: str) -> str:
    """The grad dtype the wrapper leaves on an fp16 param: fp32 where torch lets it widen (>= 2.10)."""
    return "torch.float32" if WIDENS_FP16_GRADS and dtype_name == "torch.float16" else dtype_name


def case(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    checks = Checks()
    where = dict(rank=rank, world=world, mesh=mesh)

    for how in ("rewind", "clamp"):
        checks.run(f"write_{how}", lambda how=how: _no_mismatch(writes_run(how, **where)))

    @checks("checkpoint_reload_keeps_tails")
    def reload():
        for order in ("model first", "optimizer first"):
            _no_mismatch(reload_run(order, **where), order)

    @checks("zero_grad_matches_plain")
    def zero_grad():
        for set_to_none in (True, False):
            got = zero_grad_run(set_to_none, **where)
            plain = {n: None if g is None else (widened(n, g[0]), *g[1:]) for n, g in got["plain"]["grads"].items()}
            assert got["wrapped"]["grads"] == plain, (set_to_none, got)
            assert got["wrapped"]["mains_without_grad"], got

    for dtype, short_name in ((torch.float16, "fp16"), (torch.bfloat16, "bf16")):
        for clip in (True, False):
            name = f"amp_{short_name}_{'clip' if clip else 'short'}"
            if name == "amp_fp16_clip" and not WIDENS_FP16_GRADS:
                checks.run(name, lambda: None)   # refused by torch, checked below
                continue
            checks.run(name, lambda dtype=dtype, clip=clip: _amp_matches(amp_run(dtype, clip, **where)))

    @checks("amp_skip_leaves_everything")
    def skip():
        result = amp_run(torch.float16, False, watch=2, steps=3, **where)
        assert result["skip"] == [], result["skip"]
        assert result["scales"][2][0] == result["scales"][1][0] / 2, result["scales"]
        assert result["steps"] == 2, result

    @checks("amp_fp16_clip_refused_before_torch_2_10")
    def refused():
        if WIDENS_FP16_GRADS:
            return
        try:
            amp_run(torch.float16, True, steps=1, **where)
        except ValueError as exc:
            assert "Attempting to unscale FP16 gradients" in str(exc), exc
        else:
            raise AssertionError("torch < 2.10 unscaled fp16 grads")

    return {"checks": checks.results}


def _no_mismatch(found, what=""):
    assert found == [], f"{what}: {found}"


def _amp_matches(result):
    assert result["mismatches"] == [], result["mismatches"]
    scales = result["scales"]
    assert all(a == b for a, b in scales), scales
    assert scales[2][0] == scales[1][0] / 2 and scales[4][0] == scales[3][0] / 2, scales   # backoff on inf, NaN
    assert result["steps"] == 4, result   # 6 steps, 2 skipped
