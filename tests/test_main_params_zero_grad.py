"""``zero_grad`` matches a plain optimizer for every ``set_to_none`` and dtype mix, and main grads never
outlive it (issue 42; docs/main_params.md#contract-with-torch-code).

A step moves each bf16/fp16 param's grad to its fp32 main param; ``zero_grad(set_to_none=False)`` then gives
the model param the zero grad a plain optimizer leaves (fp32 for an fp16 param whose grads the wrapper widens,
torch >= 2.10), a param that never had a grad keeps ``None``, and no main param keeps a grad. The 2-rank
``fully_shard`` run: tests/test_main_params_torch_code_two_ranks.py.
"""
import pytest
import torch

from npu_fsdp_patches.optim import MainParamsOptimizer
from tests.multirank.main_params_torch_code_cases import ADAMW, MixNet, batch, loss_of, widened, zero_grad_run


@pytest.mark.parametrize("set_to_none", [True, False, None])
def test_model_grads_after_a_step_are_what_a_plain_optimizer_leaves(set_to_none):
    got = zero_grad_run(set_to_none)
    plain = {n: None if g is None else (widened(n, g[0]), *g[1:]) for n, g in got["plain"]["grads"].items()}
    assert got["wrapped"]["grads"] == plain
    assert got["wrapped"]["mains_without_grad"]
    if not set_to_none:
        assert plain["unused"] is None and plain["a.weight"] is not None   # the case covers both kinds


def test_before_a_step_grads_are_zeroed_in_place_as_torch_does():
    model = MixNet()
    opt = MainParamsOptimizer(torch.optim.AdamW(model.parameters(), **ADAMW), model)
    loss_of(model, batch(0, 0, 1, torch.float32)).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is grads[n] and not p.grad.any() for n, p in model.named_parameters() if n in grads)


def test_main_grad_attributes_are_cleared_like_grads():
    model = MixNet()
    opt = MainParamsOptimizer(torch.optim.AdamW(model.parameters(), **ADAMW), model)
    for p in model.parameters():
        p.main_grad = torch.ones_like(p, dtype=torch.float32)
    opt.step()
    opt.zero_grad(set_to_none=False)
    assert all(not p.main_grad.any() for p in model.parameters())
    assert all(opt.main_param(p).grad is None for p in model.parameters() if p.dtype != torch.float32)
    opt.zero_grad()
    assert all(p.main_grad is None and p.grad is None for p in model.parameters())
