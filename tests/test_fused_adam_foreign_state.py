"""FusedAdam.load_state_dict of another optimizer's state carries its step or refuses with the reason
(issue 42): torch's Adam/AdamW count steps per param (``state[i]["step"]``), FusedAdam per group (TE's
``group["step"]``). Before, the moments of step 50 were kept and the group step restarted at 1, so the
next update was 41 % too large; it is now bit-identical to torch's own next step."""
import copy

import pytest
import torch

from npu_fsdp_patches.optim import FusedAdam
from tests.fault_injection import snapshot
from tests.support import bit_mismatches, run_case
from tests.torch_versions import needs_adam_decoupled_weight_decay


def _torch_run(steps=50, groups=1, cls=torch.optim.AdamW, **kw):
    """Params trained ``steps`` times by a torch optimizer (fused kernel: FusedAdam's fp32 step is
    bitwise torch's fused AdamW), and the next grads."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3, generator=gen)) for _ in range(2 * groups)]
    opt = cls([{"params": params[2 * g:2 * g + 2]} for g in range(groups)], lr=1e-3, fused=True, **kw)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return params, opt, [torch.randn(p.shape, generator=gen) for p in params]


def _fused_like(params, **kw):
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    return copies, FusedAdam([{"params": copies[i:i + 2]} for i in range(0, len(copies), 2)], lr=1e-3, **kw)


@pytest.mark.parametrize("cls, kw", [(torch.optim.AdamW, {"weight_decay": 0.01}),
                                     (torch.optim.Adam, {"weight_decay": 0.01})])
def test_torch_state_loads_with_its_step_and_the_next_step_is_torch_s(cls, kw):
    params, opt, grads = _torch_run(groups=2, cls=cls, **kw)
    copies, fused = _fused_like(params, adam_w_mode=cls is torch.optim.AdamW)
    fused.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert [g["step"] for g in fused.param_groups] == [50, 50]
    assert all("step" not in fused.state[c] for c in copies)   # carried to the group, not kept stale
    before = [p.detach().clone() for p in params]
    for p, c, g in zip(params, copies, grads):
        p.grad, c.grad = g.clone(), g.clone()
    opt.step()
    fused.step()
    for p, c, b in zip(params, copies, before):
        assert bit_mismatches(c, p) == (0, "")
        # negative control: the update of a restarted bias correction is 41 % larger, far beyond one ulp
        assert (c - b).abs().max() > 0


def test_the_old_restart_would_be_caught():
    """Negative control: the same load with the step dropped (what the old load did) moves 41 % further."""
    params, opt, grads = _torch_run()
    sd = copy.deepcopy(opt.state_dict())
    copies, fused = _fused_like(params)
    fused.load_state_dict(sd)
    for entry in sd["state"].values():
        entry["step"] = torch.tensor(0.0)   # what a restarted group step amounts to
    restarted_copies, restarted = _fused_like(params)
    restarted.load_state_dict(sd)
    restarted.param_groups[0]["step"] = 0
    for c, r, g in zip(copies, restarted_copies, grads):
        c.grad, r.grad = g.clone(), g.clone()
    start = copies[0].detach().clone()
    fused.step()
    restarted.step()
    ratio = (restarted_copies[0] - start).abs().max() / (copies[0] - start).abs().max()
    assert ratio > 1.3 and bit_mismatches(restarted_copies[0], copies[0])[0] > 0


def test_a_python_number_step_is_carried_too():
    params, opt, _ = _torch_run(steps=7)
    sd = copy.deepcopy(opt.state_dict())
    for entry in sd["state"].values():
        entry["step"] = entry["step"].item()   # torch's test_load_nontensor_step layout
    _, fused = _fused_like(params)
    fused.load_state_dict(sd)
    assert fused.param_groups[0]["step"] == 7


def _refused(sd, match, **kw):
    copies, fused = _fused_like([torch.nn.Parameter(torch.zeros(4, 3)) for _ in range(2)], **kw)
    for c in copies:
        c.grad = torch.ones_like(c)
    fused.step()
    handed = {"optimizer": fused, "params": copies}
    before = snapshot(handed)
    with pytest.raises(ValueError, match=match):
        fused.load_state_dict(sd)
    assert snapshot(handed) == before   # nothing was written


def test_params_stepped_different_numbers_of_times_are_refused():
    _, opt, _ = _torch_run(steps=5)
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][1]["step"] = torch.tensor(3.0)
    _refused(sd, r"stepped different numbers of times \(param 0: 5, param 1: 3\).*one step per group")


@pytest.mark.parametrize("edit, match", [
    (lambda sd: sd["param_groups"][0].update(amsgrad=True), "amsgrad=True; FusedAdam has no AMSGrad"),
    (lambda sd: sd["param_groups"][0].update(maximize=True), "maximize=True"),
    (lambda sd: sd["state"][0].update(momentum_buffer=torch.zeros(4, 3)), r"\['momentum_buffer'\].*does not keep"),
    (lambda sd: [e.pop("step") for e in sd["state"].values()], "moments but no step"),
    (lambda sd: sd["param_groups"][0].update(step=9), "group step 9 but its params' steps are 5"),
])
def test_state_fused_adam_cannot_honour_is_refused(edit, match):
    _, opt, _ = _torch_run(steps=5, weight_decay=0.01)
    sd = copy.deepcopy(opt.state_dict())
    edit(sd)
    _refused(sd, match)


@needs_adam_decoupled_weight_decay   # older torch's groups do not say which mode saved them
def test_the_other_weight_decay_mode_is_refused():
    _, opt, _ = _torch_run(steps=5, cls=torch.optim.Adam, weight_decay=0.01)   # L2, not decoupled
    _refused(copy.deepcopy(opt.state_dict()), "decoupled_weight_decay=False.*adam_w_mode=True")


def test_te_s_own_group_step_loads_as_before(te_site):
    """TE's real FusedAdam (group ``step``) into ours: the group step is carried, the moments equal TE's."""
    site = te_site("2.20.2")
    facts = run_case("tests.children.foreign_masters:te_state_into_ours", paths=[site])
    assert facts == {"step": 4, "moments_equal": True}
