"""Single-process unit tests of MainParamsOptimizer, its state dict, the config/dtype helpers and
the Muon + AdamW routing (docs/design.md#43-hp_fp32_main_params). Multi-rank FSDP2/DCP cases:
test_main_params_acceptance.py.
"""
import re
import warnings

import pytest
import torch
from torch import nn

from npu_fsdp_patches.optim import (Float16OptimizerWithFloat16Params, MainParamsOptimizer,
                                    apply_model_init_dtype, validate_fp32_main_params_config)
from npu_fsdp_patches.optim.muon_routing import OptimizerChain, build_muon_adamw, is_muon_param
from tests.main_params_model import Net, backward, make
from tests.torch_versions import HAS_MUON, needs_muon


@needs_muon
def test_muon_routing():
    model, chain, opt = make()
    assert set(chain.optimizers_dict) == {"adamw", "muon"}
    assert [opt.fqn(p) for p in chain.optimizers_dict["muon"].param_groups[0]["params"]] == ["body.weight"]
    assert not is_muon_param("lm_head.weight", model.lm_head.weight)
    assert not is_muon_param("embed.weight", model.embed.weight)


def test_build_muon_adamw_needs_torch_muon():
    """torch >= 2.9 builds torch.optim.Muon; older torch raises naming its version."""
    model = Net()
    if HAS_MUON:
        assert type(build_muon_adamw(model).optimizers_dict["muon"]) is torch.optim.Muon
    else:
        with pytest.raises(RuntimeError, match=re.escape(
                f"torch.optim.Muon needs torch >= 2.9 (this is torch {torch.__version__})")):
            build_muon_adamw(model)
    only_adamw = nn.ModuleDict({"embed": nn.Embedding(3, 2), "lm_head": nn.Linear(2, 3)})
    assert set(build_muon_adamw(only_adamw).optimizers_dict) == {"adamw"}   # no Muon needed


def test_alias_and_main_params():
    assert Float16OptimizerWithFloat16Params is MainParamsOptimizer
    model, chain, opt = make()
    for name, p in model.named_parameters():
        assert p.main_param is not p and p.main_param.dtype == torch.float32
        assert isinstance(p.main_param, nn.Parameter)
        assert torch.equal(p.main_param, p.float()), name
        assert opt.model_param(p.main_param) is p and opt.main_param(p) is p.main_param
    flat = [p for group in opt.float16_groups for p in group]
    mains = [p for group in opt.fp32_from_float16_groups for p in group]
    assert len(flat) == len(mains) == 4 and not any(opt.fp32_from_fp32_groups)
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(m) for m in mains}


def test_fp32_params_are_their_own_main_param():
    model, _, opt = make(torch.float32)
    assert all(p.main_param is p for p in model.parameters())
    assert opt.state_dict()["_mixed_precision_optimizer"]["fp32_from_fp16_params"] == {}


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32])
def test_unsupported_dtype_names_the_param(dtype):
    model = Net()
    model.extra = nn.Parameter(torch.zeros(3, dtype=dtype), requires_grad=dtype.is_floating_point)
    with pytest.raises(TypeError, match=r"'extra'.*" + str(dtype).split(".")[1]):
        MainParamsOptimizer(torch.optim.AdamW(model.parameters()), model)


def test_param_not_in_model_is_rejected():
    stray = nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="not a parameter of the model"):
        MainParamsOptimizer(torch.optim.AdamW([stray]), Net())


def test_existing_state_moves_with_the_param():
    torch.manual_seed(0)
    model = Net().to(torch.bfloat16)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
    backward(model)
    adamw.step()
    old = {name: adamw.state[p] for name, p in model.named_parameters()}
    opt = MainParamsOptimizer(adamw, model)
    for name, p in model.named_parameters():
        assert p not in adamw.state and adamw.state[p.main_param] is old[name]


def test_accepts_list_dict_and_chain():
    for build in (lambda m: [torch.optim.AdamW([m.body.weight]), torch.optim.SGD([m.lm_head.weight])],
                  lambda m: {"a": torch.optim.AdamW([m.body.weight]), "b": torch.optim.SGD([m.lm_head.weight])},
                  lambda m: OptimizerChain({"a": torch.optim.AdamW([m.body.weight])})):
        model = Net().to(torch.bfloat16)
        opt = MainParamsOptimizer(build(model), model)
        backward(model)
        before = model.body.weight.detach().clone()
        opt.step()
        assert not torch.equal(before, model.body.weight)
    with pytest.raises(TypeError):
        MainParamsOptimizer(object(), Net())


def test_prepare_grads_prefers_fp32_main_grad_without_copy():
    model, _, opt = make()
    backward(model)
    w = model.body.weight
    w.main_grad = torch.full(w.shape, 0.125)           # what hyper FSDP writes (fp32, grad None)
    bf16_grad_of_bias = model.body.bias.grad.clone()
    opt.prepare_grads()
    assert w.main_param.grad is w.main_grad            # fp32 main_grad: used as is, no copy
    assert model.body.bias.main_param.grad.dtype == torch.float32
    assert torch.equal(model.body.bias.main_param.grad, bf16_grad_of_bias.float())
    assert all(p.grad is None for p in model.parameters())
    opt.zero_grad()
    assert all(getattr(p, "main_grad", None) is None and p.main_param.grad is None
               for p in model.parameters())


def test_fp32_params_take_main_grad_and_zero_grad_in_place():
    model, _, opt = make(torch.float32)
    w = model.body.weight
    w.main_grad = torch.ones_like(w)
    opt.prepare_grads()
    assert w.grad is w.main_grad
    opt.zero_grad(set_to_none=False)
    assert torch.count_nonzero(w.main_grad) == 0 and torch.count_nonzero(w.grad) == 0


def test_step_keeps_fp32_tails_and_model_equals_cast_main():
    model, _, opt = make()
    for step in range(3):
        backward(model, step)
        opt.step()
        opt.zero_grad()
        for p in model.parameters():
            assert torch.equal(p, p.main_param.to(torch.bfloat16))
    tails = sum(int((p.main_param != p.float()).sum()) for p in model.parameters())
    assert tails > 0
    opt.reload_model_params()
    assert all(torch.equal(p.main_param, p.float()) for p in model.parameters())


def test_lr_scheduler_and_clipping_work_on_the_wrapper():
    model, _, opt = make()
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    backward(model)
    opt.prepare_grads()
    mains = [p for g in opt.param_groups for p in g["params"]]
    norm = torch.nn.utils.clip_grad_norm_(mains, 1e-3)
    assert norm > 1e-3
    assert torch.nn.utils.get_total_norm([p.grad for p in mains]) <= 1e-3 * 1.0001
    opt.step_with_ready_grads()
    backward(model, 1)
    opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # no "scheduler.step() before optimizer.step()"
        scheduler.step()
    assert [g["lr"] for g in opt.param_groups] == [5e-4, 0.01]
    assert len(opt.state) == 4 and opt.defaults


def test_state_dict_is_fqn_keyed_and_round_trips_exactly():
    model, _, opt = make()
    for step in range(2):
        backward(model, step)
        opt.step()
        opt.zero_grad()
    sd = opt.state_dict()
    assert set(sd["state"]) == {"embed.weight", "body.weight", "body.bias", "lm_head.weight"}
    assert set(sd["state"]["body.weight"]) == {"momentum_buffer"}
    assert set(sd["state"]["lm_head.weight"]) == {"step", "exp_avg", "exp_avg_sq"}
    assert [g["params"] for g in sd["param_groups"]] == [["embed.weight", "body.bias", "lm_head.weight"],
                                                         ["body.weight"]]
    mains = sd["_mixed_precision_optimizer"]["fp32_from_fp16_params"]
    assert all(mains[n] is p.main_param for n, p in model.named_parameters())

    model2, _, opt2 = make(seed=1)
    opt2.load_state_dict(sd)
    for name, p in model2.named_parameters():      # main params restored, not rebuilt from bf16
        assert torch.equal(p.main_param, mains[name]), name
    assert torch.equal(opt2.leaf_optimizers[1].state[model2.body.weight.main_param]["momentum_buffer"],
                       sd["state"]["body.weight"]["momentum_buffer"])


def test_plain_state_dict_rebuilds_main_params_with_warning():
    model, _, opt = make()
    backward(model)
    opt.step()
    sd = opt.state_dict()
    del sd["_mixed_precision_optimizer"]
    model2, _, opt2 = make(seed=1)
    with pytest.warns(UserWarning, match="fp32 tails"):
        opt2.load_state_dict(sd)
    assert all(torch.equal(p.main_param, p.float()) for p in model2.parameters())


def test_partial_state_dict_raises_before_loading_anything():
    model, _, opt = make()
    backward(model)
    opt.step()
    sd = opt.state_dict()
    for name in ("body.weight", "embed.weight"):
        del sd["_mixed_precision_optimizer"]["fp32_from_fp16_params"][name]
    model2, _, opt2 = make(seed=1)
    backward(model2, 5)
    opt2.step()
    before = ({k: v.clone() for k, v in opt2.state_dict()["_mixed_precision_optimizer"]
               ["fp32_from_fp16_params"].items()},
              {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt2.state.items()})
    with pytest.raises(ValueError, match="body.weight, embed.weight"):
        opt2.load_state_dict(sd)
    for name, main in opt2.main_params_by_fqn().items():
        assert torch.equal(main, before[0][name])
    for p, s in opt2.state.items():
        assert all(torch.equal(v, before[1][id(p)][k]) for k, v in s.items())


def test_mismatched_groups_raise_before_loading():
    model, _, opt = make()
    backward(model)
    opt.step()
    sd = opt.state_dict()
    sd["param_groups"][0]["params"] = ["embed.weight", "lm_head.weight", "body.bias"]
    with pytest.raises(ValueError, match="group 0"):
        opt.load_state_dict(sd)


class CachingMuon(getattr(torch.optim, "Muon", torch.optim.SGD)):   # torch < 2.9: a Muon-named SGD
    """A Muon that caches param identity at construction (like older hyper-parallel Muon)."""

    def __init__(self, params, **kw):
        super().__init__(params, **kw)
        self.cache = {id(p) for g in self.param_groups for p in g["params"]}


class ResettableMuon(CachingMuon):
    def reset_optimizer_parameters(self):
        self.cache = {id(p) for g in self.param_groups for p in g["params"]}


def test_muon_caches_are_rebuilt_or_refused():
    model = Net().to(torch.bfloat16)
    with pytest.raises(TypeError, match="reset_optimizer_parameters"):
        MainParamsOptimizer(CachingMuon([model.body.weight]), model)
    muon = ResettableMuon([model.body.weight])
    MainParamsOptimizer(muon, model)
    assert muon.cache == {id(model.body.weight.main_param)}


def test_chain_reset_gets_the_main_to_model_mapping():
    model = Net().to(torch.bfloat16)
    calls = []

    class Chain(OptimizerChain):
        def reset_optimizer_parameters(self, mapping):
            calls.append(mapping)

    MainParamsOptimizer(Chain({"adamw": torch.optim.AdamW([model.body.weight])}), model)
    (mapping,) = calls
    assert mapping == {model.body.weight.main_param: model.body.weight}


def test_validate_config():
    good = {"optimizer": {"fp32_main_params": True},
            "fsdp_config": {"mix_precision": {"reduce_dtype": "float32"}}}
    validate_fp32_main_params_config(good)
    validate_fp32_main_params_config({"optimizer": {"fp32_main_params": False}})
    for mp in ({}, {"reduce_dtype": "bfloat16"}, {"reduce_dtype": torch.float16}, {"reduce_dtype": "junk"}):
        cfg = {"optimizer": {"fp32_main_params": True}, "fsdp_config": {"mix_precision": mp}}
        with pytest.raises(ValueError) as info:
            validate_fp32_main_params_config(cfg)
        assert "optimizer.fp32_main_params" in str(info.value)
        assert "fsdp_config.mix_precision.reduce_dtype" in str(info.value)
        assert cfg["fsdp_config"]["mix_precision"] == mp          # never rewritten


def test_fp32_main_params_is_read_from_mappings_and_attribute_configs_alike():
    from types import SimpleNamespace
    from npu_fsdp_patches.optim.model_dtype import fp32_main_params_enabled
    assert fp32_main_params_enabled({"optimizer": {"fp32_main_params": True}})
    assert fp32_main_params_enabled(SimpleNamespace(optimizer=SimpleNamespace(fp32_main_params=1)))
    assert fp32_main_params_enabled(SimpleNamespace(optimizer={"fp32_main_params": True}))
    for off in ({}, {"optimizer": None}, {"optimizer": {}}, SimpleNamespace(), {"optimizer": {"fp32_main_params": 0}}):
        assert fp32_main_params_enabled(off) is False


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, "bfloat16", None])
def test_apply_model_init_dtype(dtype):
    model = Net()
    params = {n: p for n, p in model.named_parameters()}
    apply_model_init_dtype(model, dtype)
    want = {"bfloat16": torch.bfloat16, None: torch.float32}.get(dtype, dtype)
    for name, p in model.named_parameters():
        assert p is params[name] and p.dtype == want
    assert model.scale.dtype == want
    assert model.steps.dtype == torch.int32 and model.mask.dtype == torch.bool


def test_apply_model_init_dtype_rejects_other_dtypes():
    with pytest.raises(ValueError, match="model_init_dtype"):
        apply_model_init_dtype(Net(), torch.float64)
    with pytest.raises(ValueError, match="model_init_dtype"):
        apply_model_init_dtype(Net(), "int8")
