"""Single-process unit tests of npu_fsdp_patches.optim.foreach_adamw
(docs/design.md#44-hp_skip_dispatch_adamw, issue 5 item 1).

Bit-exact against torch's own foreach Adam/AdamW on plain tensors for every hyperparameter; the
multi-rank FSDP2 contract is in test_foreach_adamw_contract.py.
"""
import pytest
import torch
import torch.optim.adam as torch_adam
import torch.optim.adamw as torch_adamw

from npu_fsdp_patches.optim import foreach_adamw_step
from npu_fsdp_patches.optim.foreach_adamw import torch_dtensor_implementation
from tests.support import bit_mismatches
from tests.torch_versions import needs_adam_decoupled_weight_decay


def make_params(dtype, seed=0, shapes=((6, 5), (7,), (1,), (0,))):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in shapes]


def set_grads(params, step):
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        mag = torch.pow(10.0, -10 * torch.rand(p.shape, generator=gen))
        p.grad = (mag * torch.randn(p.shape, generator=gen).sign()).to(p.dtype)


def groups_of(params, group_kwargs):
    half = len(params) // 2
    if group_kwargs is None:
        return params
    return [{"params": params[:half], **group_kwargs[0]}, {"params": params[half:], **group_kwargs[1]}]


def run_pair(cls, dtype, kwargs, group_kwargs=None, steps=20, ref_kwargs=None, params_fn=make_params):
    ref_params, params = params_fn(dtype), params_fn(dtype)
    ref = cls(groups_of(ref_params, group_kwargs), **{**kwargs, "foreach": True, **(ref_kwargs or {})})
    opt = cls(groups_of(params, group_kwargs), **kwargs)
    for step in range(steps):
        set_grads(ref_params, step)
        set_grads(params, step)
        ref.step()
        foreach_adamw_step(opt)
        for a, b in zip(ref_params, params):
            assert bit_mismatches(a.detach(), b.detach())[0] == 0, f"step {step}: {bit_mismatches(a, b)[1]}"
            for key, value in ref.state[a].items():
                assert bit_mismatches(value, opt.state[b][key])[0] == 0, f"step {step} {key}"
    return ref, opt


CONFIGS = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.01}),
    "adam_l2": (torch.optim.Adam, {"lr": 1e-3, "weight_decay": 0.1}),
    "adam_decoupled": (torch.optim.Adam, {"lr": 1e-3, "weight_decay": 0.1, "decoupled_weight_decay": True}),
    "amsgrad": (torch.optim.AdamW, {"lr": 1e-3, "amsgrad": True}),
    "maximize": (torch.optim.AdamW, {"lr": 1e-3, "maximize": True, "weight_decay": 0.05}),
    "maximize_l2": (torch.optim.Adam, {"lr": 1e-3, "maximize": True, "weight_decay": 0.05}),
    "eps_betas": (torch.optim.AdamW, {"lr": 1e-2, "eps": 1e-6, "betas": (0.5, 0.9)}),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", [pytest.param(n, marks=needs_adam_decoupled_weight_decay)
                                  if "decoupled_weight_decay" in CONFIGS[n][1] else n
                                  for n in sorted(CONFIGS)])
def test_bitwise_equal_to_torch_foreach(name, dtype):
    cls, kwargs = CONFIGS[name]
    run_pair(cls, dtype, kwargs)


def test_two_groups_with_different_hyperparameters():
    run_pair(torch.optim.AdamW, torch.bfloat16, {},
             group_kwargs=[{"lr": 1e-3, "weight_decay": 0.01},
                           {"lr": 1e-4, "weight_decay": 0.0, "betas": (0.8, 0.95), "eps": 1e-6}])


def test_complex_params():
    run_pair(torch.optim.AdamW, torch.complex64, {"lr": 1e-3},
             params_fn=lambda dtype: make_params(dtype, shapes=((3, 2), (4,))))


def test_tensor_lr_and_betas_equal_their_float_values():
    lr, betas = torch.tensor(1e-3), (torch.tensor(0.9), torch.tensor(0.99))
    run_pair(torch.optim.AdamW, torch.bfloat16, {"lr": lr, "betas": betas},
             ref_kwargs={"lr": lr.item(), "betas": (betas[0].item(), betas[1].item())})


def test_fused_group_keeps_torch_fused_kernel(monkeypatch):
    calls = spy(monkeypatch)
    run_pair(torch.optim.AdamW, torch.bfloat16, {"lr": 1e-3, "fused": True},
             ref_kwargs={"fused": True, "foreach": None}, steps=5)
    assert set(calls) == {"_fused_adam"}


def spy(monkeypatch):
    """Record torch's Adam implementations as they run; torch 2.6's AdamW kernels (``*_adamw``, in
    torch.optim.adamw) are recorded under the Adam name of the same implementation."""
    calls = []
    for module in (torch_adam, torch_adamw):
        for name in ("_single_tensor_adam", "_multi_tensor_adam", "_fused_adam"):
            name += "" if module is torch_adam else "w"
            original = getattr(module, name, None)
            if original is None or getattr(original, "__module__", None) != module.__name__:
                continue   # torch >= 2.7: torch.optim.adamw has no kernels of its own

            def wrapper(*args, _original=original, _name=name.rstrip("w"), **kwargs):
                calls.append(_name)
                return _original(*args, **kwargs)
            monkeypatch.setattr(module, name, wrapper)
    return calls


@pytest.mark.parametrize("foreach", [None, False, True])
def test_always_takes_torch_multi_tensor_path(monkeypatch, foreach):
    calls = spy(monkeypatch)
    params = make_params(torch.bfloat16)
    opt = torch.optim.AdamW(params, foreach=foreach)
    set_grads(params, 0)
    foreach_adamw_step(opt)
    assert calls == ["_multi_tensor_adam"]


def test_interleaves_with_plain_steps_and_state_dict():
    ref_params, params = make_params(torch.bfloat16), make_params(torch.bfloat16)
    ref = torch.optim.AdamW(ref_params, foreach=True, weight_decay=0.01)
    opt = torch.optim.AdamW(params, foreach=True, weight_decay=0.01)
    for step in range(6):
        set_grads(ref_params, step)
        set_grads(params, step)
        ref.step()
        if step % 2:
            opt.step()
        else:
            foreach_adamw_step(opt)
        if step == 2:  # round-trip the state through state_dict into a fresh optimizer
            saved = opt.state_dict()
            opt = torch.optim.AdamW(params, foreach=True, weight_decay=0.01)
            opt.load_state_dict(saved)
    for a, b in zip(ref_params, params):
        assert bit_mismatches(a.detach(), b.detach())[0] == 0
    sd_ref, sd = ref.state_dict(), opt.state_dict()
    for key in sd_ref["state"]:
        assert sd["state"][key]["step"].dtype == sd_ref["state"][key]["step"].dtype
        assert sd["state"][key]["step"].device.type == "cpu"
        assert float(sd["state"][key]["step"]) == 6.0


def test_params_without_grad_are_skipped_and_closure_returns_loss():
    params = make_params(torch.float32)
    opt = torch.optim.AdamW(params)
    params[0].grad = torch.ones_like(params[0])
    before = params[1].detach().clone()
    assert foreach_adamw_step(opt, closure=lambda: torch.tensor(3.0)).item() == 3.0
    assert params[1] not in opt.state and torch.equal(params[1].detach(), before)
    assert float(opt.state[params[0]]["step"]) == 1.0


@pytest.mark.parametrize("option", ["capturable", "differentiable"])
def test_unreproducible_options_raise_naming_the_option(option):
    params = make_params(torch.float32)
    opt = torch.optim.AdamW(params, **{option: True})
    set_grads(params, 0)
    with pytest.raises(ValueError, match=rf"param_groups\[0\] sets {option}=True"):
        foreach_adamw_step(opt)


def test_rejects_other_optimizers():
    with pytest.raises(TypeError, match="SGD"):
        foreach_adamw_step(torch.optim.SGD(make_params(torch.float32), lr=0.1))


def test_torch_dtensor_implementation_follows_torch_rules(monkeypatch):
    cpu = [torch.zeros(2)]
    assert torch_dtensor_implementation(cpu, foreach=None, fused=None) == "single"  # cpu: no foreach default
    assert torch_dtensor_implementation(cpu, foreach=True, fused=None) == "foreach"
    assert torch_dtensor_implementation(cpu, foreach=False, fused=True) == "fused"
    import torch.optim.optimizer as optimizer_module
    monkeypatch.setattr(optimizer_module, "_get_foreach_kernels_supported_devices", lambda: ["cpu"])
    assert torch_dtensor_implementation(cpu, foreach=None, fused=None) == "foreach"  # as on cuda/npu
    assert torch_dtensor_implementation(cpu, foreach=None, fused=None, lr=torch.tensor(0.1)) == "single"
    assert torch_dtensor_implementation(cpu, foreach=None, fused=None, differentiable=True) == "single"
