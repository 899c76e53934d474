"""MainParamsOptimizer honours the torch.optim.Optimizer contract (issue 9 item 4, item 1).

Hooks registered on the wrapper fire as on a plain optimizer; ``state``/``param_groups`` writes
reach the leaf optimizers or are refused; LR schedulers, ``clip_grad_norm_`` and
``zero_grad(set_to_none=...)`` give bit-identical results to the plain optimizer on an fp32 model
(where the wrapper adds no cast); and the leaf check refuses cached param identity by what the
instance holds, not by its class name.
"""
import copy
import warnings

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from npu_fsdp_patches.optim import MainParamsOptimizer, apply_model_init_dtype
from npu_fsdp_patches.optim.muon_routing import build_muon_adamw
from tests.main_params_model import Net, backward, make


def test_wrapper_sets_up_everything_optimizer_init_does():
    plain = torch.optim.AdamW(Net().parameters())
    _, _, opt = make()
    missing = set(vars(plain)) - {"defaults", "state", "param_groups"} - set(vars(opt))
    assert not missing, f"Optimizer.__init__ sets {sorted(missing)}, the wrapper does not"


def _recorder(log, name):
    def hook(optimizer, *args):
        log.append((name, optimizer, float(optimizer.param_groups[0]["params"][0].detach().sum())))
    return hook


def test_instance_and_global_step_hooks_fire_around_the_step():
    model, _, opt = make()
    log = []
    handles = [opt.register_step_pre_hook(_recorder(log, "pre")),
               opt.register_step_post_hook(_recorder(log, "post")),
               register_optimizer_step_pre_hook(_recorder(log, "global_pre")),
               register_optimizer_step_post_hook(_recorder(log, "global_post"))]
    try:
        backward(model)
        opt.step()
    finally:
        for handle in handles:
            handle.remove()
    mine = [(name, value) for name, who, value in log if who is opt]
    assert [name for name, _ in mine] == ["global_pre", "pre", "post", "global_post"]
    assert mine[0][1] == mine[1][1] != mine[2][1] == mine[3][1]     # pre before, post after the update
    assert [who for _, who, _ in log if who is not opt] == []        # one step to torch code: the global
    log.clear()                                                      # hooks do not see the leaves' steps
    backward(model, 1)
    opt.step()
    assert log == []                                                 # removed handles stay removed


def test_step_pre_hook_can_replace_the_arguments():
    model, _, opt = make()
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: (args, {"closure": lambda: calls.append(1) or 3.0}))
    backward(model)
    assert opt.step() == 3.0 and calls == [1]


def test_state_dict_hooks_fire_and_may_replace_the_dict():
    model, _, opt = make()
    backward(model)
    opt.step()
    log = []
    opt.register_state_dict_pre_hook(lambda o: log.append(("pre", o)))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "extra": 7})
    sd = opt.state_dict()
    assert log == [("pre", opt)] and sd["extra"] == 7 and "main_param" in sd["state"][0]

    model2, _, opt2 = make(seed=1)
    seen = []

    def load_pre(o, state_dict):
        seen.append(state_dict.pop("extra"))       # a shallow copy: the caller's dict keeps it
        return None

    opt2.register_load_state_dict_pre_hook(load_pre)
    opt2.register_load_state_dict_post_hook(lambda o: log.append(("load_post", o)))
    opt2.load_state_dict(sd)
    assert seen == [7] and sd["extra"] == 7 and log[-1] == ("load_post", opt2)
    assert all(torch.equal(p.main_param, model.get_parameter(n).main_param)
               for n, p in model2.named_parameters())


def test_load_state_dict_pre_hook_can_substitute_the_dict():
    model, _, opt = make()
    backward(model)
    opt.step()
    good = opt.state_dict()
    model2, _, opt2 = make(seed=1)
    opt2.register_load_state_dict_pre_hook(lambda o, sd: good)
    opt2.load_state_dict({"state": {}, "param_groups": []})    # would fail the group check
    assert torch.equal(model2.body.weight.main_param, model.body.weight.main_param)


def test_state_writes_reach_the_owning_leaf():
    model, chain, opt = make()
    muon, adamw = chain.optimizers_dict["muon"], chain.optimizers_dict["adamw"]
    w, b = model.body.weight, model.body.bias      # state is keyed by model params, as torch's API needs
    assert w not in opt.state and opt.state.get(w) is None and len(opt.state) == 0
    saved_main = torch.full_like(w.main_param, 0.25)
    opt.state[w] = {"momentum_buffer": torch.ones_like(w.main_param), "main_param": saved_main}
    assert muon.state[w.main_param] == {"momentum_buffer": opt.state[w]["momentum_buffer"]}
    assert w.main_param not in adamw.state and torch.equal(w.main_param, saved_main)   # copied in place
    assert opt.state[w]["main_param"] is w.main_param and set(opt.state[w]) == {"momentum_buffer", "main_param"}
    opt.state[b]["marker"] = 1                          # defaultdict semantics, as on a plain optimizer
    assert adamw.state[b.main_param] == {"marker": 1}
    assert set(map(id, opt.state)) == {id(w), id(b)} and len(opt.state) == 2
    del opt.state[b]
    assert b.main_param not in adamw.state
    with pytest.raises(TypeError, match="cannot be deleted"):
        del opt.state[w]["main_param"]
    with pytest.raises(KeyError, match=r"fp32 main param of 'body.weight'.*keyed by the model param"):
        opt.state[w.main_param] = {}
    with pytest.raises(KeyError, match="no param of the wrapped optimizers"):
        opt.state[torch.zeros(1)]
    with pytest.raises(AttributeError, match="state is a view"):
        opt.state = {}


def test_param_group_writes_reach_the_leaf_and_structural_changes_are_refused():
    _, chain, opt = make()
    opt.param_groups[1]["lr"] = 0.5
    assert chain.optimizers_dict["muon"].param_groups[0]["lr"] == 0.5
    for change in (lambda g: g.pop(), lambda g: g.clear(), lambda g: g.insert(0, {}),
                   lambda g: g.__setitem__(0, {}), lambda g: g.__delitem__(0), lambda g: g.reverse()):
        with pytest.raises(TypeError, match="view of the wrapped optimizers' param groups"):
            change(opt.param_groups)
    with pytest.raises(AttributeError, match="param_groups is a view"):
        opt.param_groups = []
    with pytest.raises(TypeError, match="params are fixed when the group is made.*add_param_group"):
        opt.param_groups[0]["params"] = []
    with pytest.raises(TypeError, match="defaults is read-only"):
        opt.defaults["lr"] = 1.0
    with pytest.raises(ValueError, match="2 leaf optimizers and cannot tell which one"):
        opt.add_param_group({"params": []})
    copied = copy.deepcopy(opt.param_groups)
    assert type(copied) is list and copied[1]["lr"] == 0.5
    assert dict(opt.defaults) == chain.chained_optimizers[0].defaults


def _fp32_run(wrap: bool, *, set_to_none: bool, steps: int = 4):
    """AdamW + LambdaLR + clip_grad_norm_ on an fp32 model, plain or wrapped; params after each step."""
    torch.manual_seed(0)
    model = apply_model_init_dtype(Net(), torch.float32)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    opt = MainParamsOptimizer(inner, model) if wrap else inner
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    history = []
    for step in range(steps):
        backward(model, step)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        scheduler.step()
        opt.zero_grad(set_to_none=set_to_none)
        grads = [p.grad for p in model.parameters()]
        assert all(g is None for g in grads) if set_to_none else \
            all(g is not None and not g.count_nonzero() for g in grads)
        history.append([p.detach().clone() for p in model.parameters()] + [scheduler.get_last_lr()])
    return history, scheduler.state_dict()


@pytest.mark.parametrize("set_to_none", [True, False])
def test_scheduler_clipping_and_zero_grad_match_the_plain_optimizer_bitwise(set_to_none):
    with warnings.catch_warnings():
        warnings.simplefilter("error")       # e.g. "lr_scheduler.step() before optimizer.step()"
        plain, plain_sched = _fp32_run(False, set_to_none=set_to_none)
        wrapped, wrapped_sched = _fp32_run(True, set_to_none=set_to_none)
    for step, (a, b) in enumerate(zip(plain, wrapped)):
        assert a[-1] == b[-1], step
        for x, y in zip(a[:-1], b[:-1]):
            assert torch.equal(x, y), step
    assert plain_sched["last_epoch"] == wrapped_sched["last_epoch"] == 4


def test_bitwise_comparison_catches_one_ulp():
    """Negative control for the test above: a 1-ulp change of one element is a mismatch."""
    history, _ = _fp32_run(True, set_to_none=True, steps=1)
    x = history[0][0]
    y = x.clone()
    y.view(-1)[0] = torch.nextafter(y.view(-1)[0], torch.tensor(float("inf")))
    assert not torch.equal(x, y)


def test_bf16_scheduler_and_clipping_reach_the_main_params():
    model, chain, opt = make()
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    backward(model)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)       # on the bf16 grads, as in plain use
    clipped = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    for name, p in model.named_parameters():
        assert torch.equal(p.main_param.grad, clipped[name].float()), name
    with warnings.catch_warnings():
        warnings.simplefilter("error")       # the scheduler saw the wrapper's step
        scheduler.step()
    assert [g["lr"] for g in chain.optimizers_dict["adamw"].param_groups] == [5e-4]
    assert [g["lr"] for g in chain.optimizers_dict["muon"].param_groups] == [0.01]
    opt.zero_grad(set_to_none=False)   # issue 42: zero grads where a plain optimizer leaves them, no fp32 buffer kept
    for p in model.parameters():
        assert p.main_param.grad is None and p.grad.dtype == p.dtype and not p.grad.count_nonzero()


# ---- item 1: cached param identity is detected on the instance, not by class name -------------

if hasattr(torch.optim, "Muon"):
    MuonBase = torch.optim.Muon
else:
    class MuonBase(torch.optim.SGD):
        """torch < 2.9 has no Muon: a momentum SGD keeps what these tests are about, a "muon" name
        and a per-param state (``momentum_buffer``), next to what the instance holds besides it."""

        def __init__(self, params, lr=0.02):
            super().__init__(params, lr=lr, momentum=0.95)


class DistributedMuonLike(MuonBase):
    """Named like veomni's DistributedMuon and, like it, keys nothing but ``state`` by param."""

    def __init__(self, params, **kw):
        super().__init__(params, **kw)
        self.world_size = 1
        self.scratch = {"ns_steps": 5}


class CachingAdamW(torch.optim.AdamW):
    """No "muon" in the name, but remembers its params in a helper object's list."""

    class Plan:
        def __init__(self, params):
            self.order = list(params)

    def __init__(self, params, **kw):
        super().__init__(params, **kw)
        self.plan = self.Plan(p for g in self.param_groups for p in g["params"])


class IdKeyedMuon(MuonBase):
    def __init__(self, params, **kw):
        super().__init__(params, **kw)
        self.shard_of = {id(p): 0 for g in self.param_groups for p in g["params"]}


def test_a_muon_that_keys_only_state_by_param_is_accepted():
    model = Net().to(torch.bfloat16)
    opt = MainParamsOptimizer(DistributedMuonLike([model.body.weight], lr=0.02), model)
    backward(model)
    opt.step()
    assert model.body.weight.main_param in opt.leaf_optimizers[0].state


@pytest.mark.parametrize("cls, where", [(CachingAdamW, r"CachingAdamW\.plan\.order\[0\] -> 'body.weight'"),
                                        (IdKeyedMuon, r"IdKeyedMuon\.shard_of<key 0> -> 'body.weight'")])
def test_cached_param_identity_is_refused_whatever_the_name(cls, where):
    model = Net().to(torch.bfloat16)
    with pytest.raises(TypeError, match=where):
        MainParamsOptimizer(cls([model.body.weight]), model)


def test_fp32_params_are_not_swapped_so_caches_of_them_are_fine():
    model = Net()
    MainParamsOptimizer(CachingAdamW(model.parameters()), model)
