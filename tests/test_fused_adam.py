"""npu_fsdp_patches.optim.FusedAdam on plain tensors (single process): API, errors, numerics."""
import inspect
import warnings

import pytest
import torch

from npu_fsdp_patches.optim import FusedAdam
from npu_fsdp_patches.optim import fused_adam_step
from npu_fsdp_patches.optim.fused_adam_state import compute_scale


def _train(opt_cls, p0, grads, **kw):
    p = torch.nn.Parameter(p0.clone())
    opt = opt_cls([p], **kw)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach(), opt


def _data(n=1000, steps=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen), [torch.randn(n, generator=gen) for _ in range(steps)]


def test_exported_lazily_and_signature_is_nvte_2_1():
    import npu_fsdp_patches.optim as optim
    assert optim.FusedAdam is FusedAdam
    params = inspect.signature(FusedAdam.__init__).parameters
    positional = [n for n, p in params.items() if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert positional == ["self", "params", "lr", "betas", "eps", "weight_decay", "amsgrad"]
    kwonly = {n: p.default for n, p in params.items() if p.kind == p.KEYWORD_ONLY}
    assert kwonly == {"bias_correction": True, "adam_w_mode": True, "capturable": False,
                      "master_weights": False, "master_weight_dtype": torch.float32,
                      "exp_avg_dtype": torch.float32, "exp_avg_sq_dtype": torch.float32,
                      "use_decoupled_grad": False, "store_param_remainders": False,
                      "set_grad_none": None}
    assert list(inspect.signature(FusedAdam.get_unscaled_state).parameters) == [
        "self", "param", "state_name", "skip_unscale"]
    assert inspect.signature(FusedAdam.initialize_state).parameters[
        "store_param_remainders"].default is None
    assert list(inspect.signature(FusedAdam.step).parameters) == ["self", "closure", "grad_scaler"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(amsgrad=True), "FusedAdam does not support the AMSGrad variant."),
    (dict(master_weights=True, master_weight_dtype=torch.bfloat16),
     "FusedAdam only supports fp32/fp16 master weights."),
    (dict(exp_avg_dtype=torch.int8), "FusedAdam only supports fp32/fp16/bf16/fp8 exp_avg."),
    (dict(exp_avg_sq_dtype=torch.float64), "FusedAdam only supports fp32/fp16/bf16/fp8 exp_avg_sq."),
    (dict(capturable=True, master_weights=True, master_weight_dtype=torch.float16),
     "Capturable mode only supports fp32 master weights."),
    (dict(capturable=True, exp_avg_dtype=torch.float16), "Capturable mode requires exp_avg_dtype"),
    (dict(capturable=True, master_weights=True, store_param_remainders=True),
     "Capturable mode doesn't support storing param remainders"),
    (dict(capturable=True), "does not support capturable=True"),
])
def test_constructor_errors_are_te_s(kwargs, message):
    with pytest.raises(RuntimeError) as err:
        FusedAdam([torch.nn.Parameter(torch.zeros(2))], **kwargs)
    assert message in str(err.value)


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_fp32_is_bitwise_torch_fused_adamw_with_negative_control(wd):
    p0, grads = _data()
    ours, _ = _train(FusedAdam, p0, grads, lr=1e-2, weight_decay=wd)
    ref, _ = _train(torch.optim.AdamW, p0, grads, lr=1e-2, weight_decay=wd, fused=True)
    assert torch.equal(ours, ref)
    off_by_one_ulp = torch.nextafter(ref, torch.full_like(ref, float("inf")))
    assert not torch.equal(ours, off_by_one_ulp)  # the check sees a 1-ulp difference


def test_foreach_fallback_and_no_bias_correction_match_the_te_kernel_math(monkeypatch):
    p0, grads = _data(n=257)
    fused, _ = _train(FusedAdam, p0, grads, lr=1e-2, weight_decay=0.1)
    monkeypatch.setattr(fused_adam_step, "_FUSED_DEVICES", frozenset())
    calls = []
    monkeypatch.setattr(torch, "_fused_adamw_", lambda *a, **k: calls.append(1))
    foreach, _ = _train(FusedAdam, p0, grads, lr=1e-2, weight_decay=0.1)
    assert not calls
    torch.testing.assert_close(foreach, fused, rtol=1e-6, atol=1e-7)
    monkeypatch.undo()
    nobc, _ = _train(FusedAdam, p0, grads, lr=1e-2, bias_correction=False)
    p, m, v = p0.double(), torch.zeros(257, dtype=torch.float64), torch.zeros(257,
                                                                           dtype=torch.float64)
    for g in grads:  # docs/te_fused_adam.md#17-kernel-math with bias_correction=0
        m = 0.9 * m + 0.1 * g.double()
        v = 0.999 * v + 0.001 * g.double() ** 2
        p = p - 1e-2 * m / (v.sqrt() + 1e-8)
    torch.testing.assert_close(nobc, p.float(), rtol=1e-6, atol=1e-7)


def test_l2_mode_never_mutates_the_grad_and_matches_torch_adam():
    p0, grads = _data()
    p = torch.nn.Parameter(p0.clone())
    opt = FusedAdam([p], lr=1e-2, weight_decay=0.3, adam_w_mode=False)
    for g in grads:
        p.grad = g.clone()
        opt.step()
        assert torch.equal(p.grad, g)
    ref, _ = _train(torch.optim.Adam, p0, grads, lr=1e-2, weight_decay=0.3)
    torch.testing.assert_close(p.detach(), ref, rtol=1e-6, atol=1e-7)


def test_zero_grad_semantics():
    p = torch.nn.Parameter(torch.zeros(3))
    opt = FusedAdam([p])
    p.grad = torch.ones(3)
    opt.zero_grad()
    assert p.grad is None
    p.grad = torch.ones(3)
    opt.zero_grad(set_to_none=False)
    assert torch.equal(p.grad, torch.zeros(3))
    opt = FusedAdam([p], use_decoupled_grad=True)
    p.decoupled_grad = torch.ones(3)
    opt.zero_grad(set_to_none=False)
    assert torch.equal(p.decoupled_grad, torch.zeros(3))
    opt.zero_grad()
    assert p.decoupled_grad is None
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        opt = FusedAdam([p], set_grad_none=False)
    assert any(issubclass(x.category, DeprecationWarning) for x in w)
    with pytest.raises(ValueError, match="set_grad_none=False"):
        opt.zero_grad(set_to_none=True)


def test_initialize_state_one_arg_and_contradicting_value():
    b = torch.nn.Parameter(torch.randn(4).bfloat16())
    opt = FusedAdam([b], master_weights=True, store_param_remainders=True)
    opt.initialize_state(b)
    assert opt.state[b]["master_param"].dtype == torch.int16
    with pytest.raises(ValueError, match="contradicts"):
        FusedAdam([b], master_weights=True, store_param_remainders=True).initialize_state(b, False)
    f = torch.nn.Parameter(torch.randn(4))
    opt = FusedAdam([f], master_weights=True, store_param_remainders=True)
    opt.initialize_state(f, False)  # remainders are only for bf16: False agrees
    assert opt.state[f]["master_param"].dtype == torch.float32
    with pytest.raises(ValueError, match="must be False"):
        FusedAdam([f], master_weights=True).initialize_state(f, True)


def test_fp16_scale_rule_including_zero_nonfinite_and_empty():
    x = torch.tensor([0.5, -3.0, 2.0])
    assert compute_scale(x, torch.float16).item() == pytest.approx(3.0 / (65504.0 / 2))
    for bad in (torch.zeros(4), torch.tensor([1.0, float("inf")]), torch.tensor([float("nan")]),
                torch.zeros(0)):
        assert compute_scale(bad, torch.float16).item() == 1.0
    tiny = torch.tensor([1e-40])  # absmax / range is a positive denormal: clamped to tiny
    assert compute_scale(tiny, torch.float16).item() == torch.finfo(torch.float32).tiny


def test_low_precision_states_get_set_roundtrip_and_skip_unscale():
    p = torch.nn.Parameter(torch.randn(16))
    opt = FusedAdam([p], exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.bfloat16)
    opt.initialize_state(p)
    value = torch.randn(16) * 1e-3
    opt.set_scaled_state(p, "exp_avg", value)
    assert opt.state[p]["exp_avg"].dtype == torch.float16
    torch.testing.assert_close(opt.get_unscaled_state(p, "exp_avg"), value, rtol=1e-3, atol=0)
    opt.set_scaled_state(p, "exp_avg_sq", value.abs())
    raw = opt.get_unscaled_state(p, "exp_avg_sq", skip_unscale=True)
    assert raw.dtype == torch.bfloat16 and raw is opt.state[p]["exp_avg_sq"]
    assert opt.get_unscaled_state(p, "exp_avg_sq").dtype == torch.float32
    with pytest.raises(TypeError, match="must be given as torch.float32"):
        opt.set_scaled_state(p, "exp_avg", value.half())


def test_fp8_moments_on_plain_tensors_track_the_fp32_run():
    p0, grads = _data(n=64)
    fp8, opt = _train(FusedAdam, p0, grads, lr=1e-2, exp_avg_dtype=torch.uint8,
                      exp_avg_sq_dtype=torch.uint8)
    assert opt.state[list(opt.state)[0]]["exp_avg"].dtype == torch.uint8
    ref, _ = _train(FusedAdam, p0, grads, lr=1e-2)
    torch.testing.assert_close(fp8, ref, rtol=1e-2, atol=1e-2)


def test_state_dict_roundtrip_and_bad_load_changes_nothing():
    p0, grads = _data(n=32)
    b = torch.nn.Parameter(p0.bfloat16())
    opt = FusedAdam([b], master_weights=True, master_weight_dtype=torch.float16,
                    exp_avg_dtype=torch.float16)
    for g in grads:
        b.grad = g.bfloat16()
        opt.step()
    sd = opt.state_dict()
    assert {k: v.dtype for k, v in sd["state"][0].items()} == {
        "exp_avg": torch.float32, "exp_avg_sq": torch.float32, "master_param": torch.float32}
    assert sd["param_groups"][0]["step"] == 5
    c = torch.nn.Parameter(b.detach().clone())
    opt2 = FusedAdam([c], master_weights=True, master_weight_dtype=torch.float16,
                     exp_avg_dtype=torch.float16)
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["step"] == 5
    assert opt2.state[c]["master_param"].dtype == torch.float16
    torch.testing.assert_close(opt2.get_unscaled_state(c, "exp_avg"),
                               opt.get_unscaled_state(b, "exp_avg"), rtol=1e-3, atol=1e-6)
    bad = {"state": {0: {"exp_avg": torch.zeros(5)}}, "param_groups": sd["param_groups"]}
    before = opt2.get_unscaled_state(c, "exp_avg").clone()
    with pytest.raises(RuntimeError, match="has shape"):
        opt2.load_state_dict(bad)
    assert torch.equal(opt2.get_unscaled_state(c, "exp_avg"), before)
    assert opt2.param_groups[0]["step"] == 5
