"""Rank side of the FP8 part of te_fused_adam_empty_scale on TE's real FusedAdam (tests/te_real.py; the
``Float8Tensor`` and its cast are the CPU stand-ins of tests/fixtures/te_real_shim and te_torch_cpu).

``zero_expert_case``: FP8 moments (``exp_avg_dtype = exp_avg_sq_dtype = torch.uint8``), one param with
grads and one "expert" that gets only zero grads (no tokens), ``STEPS`` steps, a ``state_dict`` saved
and loaded into a fresh optimizer, one more step: are the expert's moments and param finite, and are its
moments exactly zero? ``scaling_case``: the patched ``_apply_scale`` against the release's own, on FP8
states of every kind (random, tiny, huge, with inf, with NaN, one element, all zero): every result but the
all-zero one must be bit for bit TE's, with a control that one flipped bit is seen.
"""
from __future__ import annotations

import torch

import npu_fsdp_patches
from tests.support import bit_mismatches

LR, WD, STEPS = 1e-2, 0.1, 3
FP8 = {"exp_avg_dtype": torch.uint8, "exp_avg_sq_dtype": torch.uint8}


def _fused_adam():
    from transformer_engine.pytorch.optimizers import FusedAdam
    return FusedAdam


def _finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())


def _moments(opt, p) -> list:
    return [opt.get_unscaled_state(p, name).clone() for name in ("exp_avg", "exp_avg_sq")]


def zero_expert_case() -> dict:
    FusedAdam = _fused_adam()
    gen = torch.Generator().manual_seed(8)
    live, expert = (torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (6, 4))
    opt = FusedAdam([live, expert], lr=LR, weight_decay=WD, **FP8)
    finite = []
    for _ in range(STEPS):
        live.grad, expert.grad = torch.randn(6, generator=gen), torch.zeros(4)
        opt.step()
        finite.append(all(_finite(t) for t in _moments(opt, expert) + [expert.detach()]))
    twin = [torch.nn.Parameter(p.detach().clone()) for p in (live, expert)]
    loaded = FusedAdam(twin, lr=LR, weight_decay=WD, **FP8)
    loaded.load_state_dict(opt.state_dict())
    after_load = _moments(loaded, twin[1])
    twin[0].grad, twin[1].grad = torch.randn(6, generator=gen), torch.zeros(4)
    loaded.step()
    return {"finite_per_step": finite, "loaded_zero": all(bool((m == 0).all()) for m in after_load),
            "finite_after_resume": all(_finite(t) for t in _moments(loaded, twin[1]) + [twin[1].detach()]),
            "live_finite": _finite(live.detach()) and _finite(twin[0].detach())}


#: FP8 states of every kind: (name, fp32 values)
STATES = {
    "random": lambda g: torch.randn(33, generator=g),
    "tiny": lambda g: torch.randn(7, generator=g) * 1e-30,
    "huge": lambda g: torch.randn(7, generator=g) * 1e30,
    "with_inf": lambda g: torch.tensor([1.0, float("inf"), -2.0]),
    "with_nan": lambda g: torch.tensor([0.5, float("nan"), -0.25]),
    "one_element": lambda g: torch.tensor([-3.0]),
    "all_zero": lambda g: torch.zeros(5),
}


def _scaled(fn, values: torch.Tensor) -> dict:
    """``fn`` (an ``_apply_scale``) on a fresh FP8 state: the scale, the cast scale and the stored state."""
    p = torch.nn.Parameter(torch.zeros(values.numel()))
    opt = _fused_adam()([p], lr=LR, **FP8)
    opt._initialize_state(p, "exp_avg", zero_buffer=True)   # the same call in TE 1.13 and 2.x
    state, scale = opt.state[p]["exp_avg"], opt._scales[p]["exp_avg"]
    fn(opt, "exp_avg", values.clone(), state, scale)
    quantizer = getattr(state, "_quantizer", None)
    return {"scale": scale.clone(), "scale_inv": state._scale_inv.clone(), "data": state._data.clone(),
            "cast_scale": quantizer.scale.clone() if quantizer is not None else 1 / state._scale_inv,
            "dequantized": state.float().clone()}


def scaling_case() -> dict:
    from npu_fsdp_patches.patch import unpatched
    cls = _fused_adam()
    patched = cls.__dict__["_apply_scale"]
    original = unpatched(patched)
    out = {"patched": patched is not original}
    for name, make in STATES.items():
        values = make(torch.Generator().manual_seed(len(name)))
        ours, theirs = _scaled(patched, values), _scaled(original, values)
        out[name] = {key: bit_mismatches(ours[key], theirs[key])[0] for key in ours}
        # a state with inf or NaN stays TE's (non-finite); every finite one must come out finite
        out[name]["finite"] = not _finite(values) or (_finite(ours["cast_scale"]) and _finite(ours["dequantized"]))
        out[name]["te_finite"] = _finite(theirs["cast_scale"]) and _finite(theirs["dequantized"])
    control = _scaled(patched, STATES["random"](torch.Generator().manual_seed(6)))["data"]
    nudged = control.clone()
    nudged[0] ^= 1
    out["control_caught"] = bit_mismatches(control, nudged)[0] == 1
    return out


def fp8_cases() -> dict:
    """Both cases on TE's own code (every patch reverted), then with the matrix's patches."""
    status = {r["name"]: r["state"] for r in npu_fsdp_patches.status()}
    npu_fsdp_patches.revert()
    unpatched = {"zero_expert": zero_expert_case()}
    npu_fsdp_patches.apply(*[n for n, s in status.items() if s == "applied"])
    return {"status": status, "unpatched": unpatched,
            "patched": {"zero_expert": zero_expert_case(), "scaling": scaling_case()}}
