"""fp16 and bf16 training through torch's own ``torch.amp.GradScaler`` (issue 42;
docs/main_params.md#fp16-and-torchs-gradscaler).

torch's recipe runs unchanged on a wrapper over fp16 or bf16 params, with clipping (``unscale_``,
``clip_grad_norm_``, ``step``, ``update``) and without, and matches an fp32-master reference driven by a scaler
of the same settings bit for bit: params, main params, moments, step counts and the scale after every step,
over steps with an inf and a NaN grad (skipped, the scale backed off). Plain tensors here; the same runs on 2
``fully_shard`` ranks: tests/test_main_params_torch_code_two_ranks.py.
"""
import pytest
import torch

from npu_fsdp_patches.optim import MainParamsOptimizer
from npu_fsdp_patches.optim._loss_scaling import WIDENS_FP16_GRADS
from tests.multirank.main_params_torch_code_cases import ADAMW, _amp_matches, amp_run, build, batch, loss_of
from tests.support import bit_mismatches

needs_grad_dtype = pytest.mark.skipif(
    not WIDENS_FP16_GRADS, reason=f"an fp16 param holds fp32 grads from torch 2.10 (Tensor.grad_dtype); this is "
                                  f"torch {torch.__version__}, whose GradScaler.unscale_ refuses fp16 grads "
                                  f"(test_fp16_clipping_before_torch_2_10_is_refused_by_torch)")


@pytest.mark.parametrize("clip", [pytest.param(True, id="clip"), pytest.param(False, id="short")])
@pytest.mark.parametrize("dtype", [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16"),
                                   pytest.param(torch.float32, id="fp32")])
def test_torchs_recipe_matches_an_fp32_master_reference(dtype, clip):
    if dtype == torch.float16 and clip and not WIDENS_FP16_GRADS:
        pytest.skip(needs_grad_dtype.kwargs["reason"])
    _amp_matches(amp_run(dtype, clip))


def test_a_skipped_step_changes_nothing_and_backs_off_the_scale():
    """An inf grad: main params, moments, step counts and model params bit-identical across scaler.step."""
    result = amp_run(torch.float16, False, watch=2, steps=3)
    assert result["skip"] == [] and result["steps"] == 2
    assert result["scales"][2][0] == result["scales"][1][0] / 2


def test_the_skip_check_catches_a_step_that_was_not_skipped(monkeypatch):
    """Negative control: a wrapper that ignores the scaler's inf flag steps on the inf grad, and the check sees it."""
    import npu_fsdp_patches.optim.main_params as main_params
    monkeypatch.setattr(main_params, "found_inf", lambda opt: False)
    assert amp_run(torch.float16, False, watch=2, steps=3)["skip"] != []


def test_the_comparison_catches_grads_left_scaled(monkeypatch):
    """Negative control: without the wrapper's own unscale (short form) the results differ from the reference."""
    monkeypatch.setattr(MainParamsOptimizer, "_unscale_main_grads", lambda self: None)
    assert amp_run(torch.float16, False)["mismatches"] != []


@needs_grad_dtype
def test_fp16_params_hold_fp32_grads_that_torch_unscales_and_clips():
    model = build(torch.float16, None)
    opt = MainParamsOptimizer(torch.optim.AdamW(model.parameters(), **ADAMW), model)
    loss_of(model, batch(0, 0, 1, torch.float16)).backward()
    assert {p.grad.dtype for p in model.parameters()} == {torch.float32}
    assert all(p.dtype == torch.float16 and p.grad_dtype is None for p in model.parameters())
    opt.step()
    assert all(p.dtype == torch.float16 for p in model.parameters())


@pytest.mark.skipif(WIDENS_FP16_GRADS, reason="torch >= 2.10 widens fp16 grads: the recipe with clipping works")
def test_fp16_clipping_before_torch_2_10_is_refused_by_torch():
    """The documented fallback's boundary: torch's own ValueError, before the scaler or the wrapper changed
    anything; the short form works (test_torchs_recipe_matches_an_fp32_master_reference[fp16-short])."""
    model = build(torch.float16, None)
    opt = MainParamsOptimizer(torch.optim.AdamW(model.parameters(), **ADAMW), model)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(loss_of(model, batch(0, 0, 1, torch.float16))).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.unscale_(opt)
    assert all(bit_mismatches(p.grad, g)[0] == 0 for p, g in zip(model.parameters(), grads))


def test_a_wrapper_copy_widens_its_own_params():
    import copy
    model = build(torch.float16, None)
    opt = MainParamsOptimizer(torch.optim.AdamW(model.parameters(), **ADAMW), model)
    other = copy.deepcopy(opt)
    loss_of(other.model, batch(0, 0, 1, torch.float16)).backward()
    want = torch.float32 if WIDENS_FP16_GRADS else torch.float16
    assert {p.grad.dtype for p in other.model.parameters()} == {want}
    assert all(p.grad is None for p in model.parameters())
