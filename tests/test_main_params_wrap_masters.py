"""Wrapping an optimizer that already keeps fp32 masters of its own is refused before anything is written
(issue 42): another MainParamsOptimizer (also inside a chain), hyper-parallel's own wrapper, our and TE's
FusedAdam(master_weights=True), veomni's MasterFP32AdamW and its subclasses. Two fp32 copies would
cost 4 B per element more and drift apart; before, the wrap failed midway and its rollback failed too,
losing the inner optimizer's moments. Detection is by what the optimizer has (docs/main_params.md
#contract-with-torch-code); the fault-injection entries are in tests/test_fault_injection.py."""
import pytest
import torch
from torch import nn

from npu_fsdp_patches.optim import FusedAdam, MainParamsOptimizer
from npu_fsdp_patches.optim.muon_routing import OptimizerChain
from tests.fault_injection import snapshot
from tests.main_params_model import Net, backward
from tests.support import bit_mismatches, load_fixture_module, run_case

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _inner(steps):
    torch.manual_seed(0)
    model = Net().to(torch.bfloat16)
    inner = MainParamsOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model)
    for s in range(steps):
        backward(model, s)
        inner.step()
        inner.zero_grad()
    return model, inner


def _train(model, opt, steps, start=3):
    for s in range(start, start + steps):
        backward(model, s)
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("outer", [lambda inner: inner, lambda inner: OptimizerChain({"inner": inner}),
                                   lambda inner: [inner]], ids=["wrapper", "chain", "list"])
def test_wrapping_a_wrapper_is_refused_and_changes_nothing(outer):
    model, inner = _inner(3)
    handed = {"model": model, "optimizer": inner}
    before = snapshot(handed)
    with pytest.raises(TypeError, match="already is a main-params wrapper.*Nothing was changed"):
        MainParamsOptimizer(outer(inner), model)
    assert snapshot(handed) == before        # identity and bits of every param, main param and moment
    ref_model, ref = _inner(3)               # and training goes on exactly as if nothing was tried
    for a, b in zip(_train(model, inner, 3), _train(ref_model, ref, 3)):
        assert bit_mismatches(a, b) == (0, "")


def test_hyper_parallel_s_own_wrapper_is_refused():
    up = load_fixture_module("upstream_fp32_wrapper/mixed_precision_optimizer.py")
    model = Net().to(torch.bfloat16)
    chain = up.ChainedOptimizer(model, {"adamw": torch.optim.AdamW(model.parameters())})
    wrapper = up.Float16OptimizerWithFloat16Params(chain, model)
    with pytest.raises(TypeError, match="Float16OptimizerWithFloat16Params has fp32_from_float16_groups"):
        MainParamsOptimizer(wrapper, model)


class KeepsCopies(torch.optim.AdamW):
    """Named for nothing: keeps an fp32 copy of each param in its state once it stepped."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["fp32_master"] = p.float()
        return loss


def _veomni(name):
    return getattr(load_fixture_module("veomni_master_fp32/master_fp32_adamw.py"), name)




LEAVES = {
    "our FusedAdam(master_weights=True)": (lambda ps: FusedAdam(ps, master_weights=True), 0,
                                           r"master_weights=True"),
    "our FusedAdam(master_weights=True), stepped": (lambda ps: FusedAdam(ps, master_weights=True), 2,
                                                    r"master_weights=True"),
    "veomni MasterFP32AdamW, stepped": (lambda ps: _veomni("MasterFP32AdamW")(ps), 2,
                                        r"state already holds master copies.*'master_weight'"),
    "veomni FullFP32AdamW, before its first step": (lambda ps: _veomni("FullFP32AdamW")(ps), 0,
                                                    r"class FullFP32AdamW keeps fp32 master weights.*MasterFP32AdamW"),
    "veomni CPUOffloadAdamW-like subclass": (lambda ps: type("CPUOffloadAdamW", (_veomni("FullFP32AdamW"),), {})(ps), 0,
                                             r"CPUOffloadAdamW keeps fp32 master weights"),
    "an unnamed optimizer whose state holds fp32 copies": (lambda ps: KeepsCopies(ps), 1, r"'fp32_master'"),
}


@pytest.mark.parametrize("name", LEAVES)
def test_leaves_that_keep_fp32_masters_are_refused(name):
    make, steps, reason = LEAVES[name]
    torch.manual_seed(0)
    model = Net().to(torch.bfloat16)
    leaf = make(list(model.parameters()))
    _train(model, leaf, steps, start=0)
    handed = {"model": model, "optimizer": leaf}
    before = snapshot(handed)
    with pytest.raises(TypeError, match=reason):
        MainParamsOptimizer(leaf, model)
    assert snapshot(handed) == before


@pytest.mark.parametrize("make", [lambda ps: FusedAdam(ps, master_weights=False), torch.optim.AdamW,
                                  lambda ps: KeepsCopies(ps)], ids=["FusedAdam", "AdamW", "unnamed, not stepped"])
def test_leaves_without_masters_wrap_and_step(make):
    """The other side: no flag, no master state, no master class: wrapped (an unnamed leaf that keeps copies
    only from its first step on cannot be told apart before it: the documented limit)."""
    torch.manual_seed(0)
    model = Net().to(torch.bfloat16)
    opt = MainParamsOptimizer(make(list(model.parameters())), model)
    _train(model, opt, 1)
    assert all(p.main_param.dtype == torch.float32 for p in model.parameters())


def test_te_fused_adam_with_master_weights_is_refused(te_site):
    """TE's real FusedAdam (2.20.2's fused_adam.py): master_weights=True refused after 3 steps with nothing
    changed; master_weights=False wraps and steps."""
    facts = run_case("tests.children.foreign_masters:te_master_weights_refused", paths=[te_site("2.20.2")])
    assert facts["error"] is not None and "master_weights=True" in facts["error"], facts
    assert facts["unchanged"] and facts["without_masters_steps"], facts
