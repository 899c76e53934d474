"""Child side of the tests that meet Transformer Engine's real FusedAdam (a te_site on the path):
wrapping it when it keeps fp32 master weights of its own (tests/test_main_params_wrap_masters.py), and
loading its state into our FusedAdam (tests/test_fused_adam_foreign_state.py)."""
import warnings

import torch
from torch import nn

warnings.filterwarnings("ignore")


def _te_fused_adam():
    from transformer_engine.pytorch.optimizers.fused_adam import FusedAdam
    return FusedAdam


def _trained(dtype, steps, **kw):
    torch.manual_seed(0)
    model = nn.Linear(4, 3).to(dtype)
    opt = _te_fused_adam()(model.parameters(), lr=1e-2, **kw)
    for _ in range(steps):
        model(torch.randn(2, 4, dtype=dtype)).float().pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def te_master_weights_refused() -> dict:
    """TE FusedAdam(master_weights=True), stepped 3 times: wrapping it is refused and changes nothing;
    the same leaf without master weights wraps and steps."""
    from npu_fsdp_patches.optim import MainParamsOptimizer
    from tests.fault_injection import snapshot
    model, opt = _trained(torch.bfloat16, 3, master_weights=True)
    before = snapshot({"model": model, "optimizer": opt})
    try:
        MainParamsOptimizer(opt, model)
        error = None
    except TypeError as exc:
        error = str(exc)
    unchanged = snapshot({"model": model, "optimizer": opt}) == before
    plain_model, plain = _trained(torch.bfloat16, 0, master_weights=False)
    wrapper = MainParamsOptimizer(plain, plain_model)
    plain_model(torch.randn(2, 4, dtype=torch.bfloat16)).float().pow(2).sum().backward()
    wrapper.step()
    return {"error": error, "unchanged": unchanged,
            "without_masters_steps": bool(plain.param_groups[0]["step"] == 1)}


def te_state_into_ours() -> dict:
    """TE FusedAdam's state (group ``step``) loaded into our FusedAdam."""
    from npu_fsdp_patches.optim import FusedAdam
    model, opt = _trained(torch.float32, 4)
    copies = [nn.Parameter(p.detach().clone()) for p in model.parameters()]
    ours = FusedAdam(copies, lr=1e-2)
    ours.load_state_dict(opt.state_dict())
    equal = all(torch.equal(ours.state[c][k], opt.state[p][k])
                for c, p in zip(copies, model.parameters()) for k in ("exp_avg", "exp_avg_sq"))
    return {"step": ours.param_groups[0]["step"], "moments_equal": equal}
