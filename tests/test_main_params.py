"""Single-process unit tests of MainParamsOptimizer, its state dict, the config/dtype helpers and
the Muon + AdamW routing (docs/design.md#43-hp_fp32_main_params). Multi-rank FSDP2/DCP cases:
test_main_params_acceptance.py.
"""
import copy
import re
import warnings

import pytest
import torch
from torch import nn

from npu_fsdp_patches.optim import (Float16OptimizerWithFloat16Params, MainParamsOptimizer,
                                    apply_model_init_dtype, validate_fp32_main_params_config)
from npu_fsdp_patches.optim.muon_routing import OptimizerChain, build_muon_adamw, is_muon_param
from tests.main_params_model import Net, backward, make
from tests.support import bit_mismatches
from tests.torch_versions import FLAT_LOAD_FILLS_MISSING_KEYS, HAS_MUON, needs_muon


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
    # torch code sees the model params (identity, as named_parameters()); the leaves step the mains
    assert [id(p) for g in opt.param_groups for p in g["params"]] == \
        [id(opt.model_param(m)) for leaf in opt.leaf_optimizers for g in leaf.param_groups for m in g["params"]]
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in flat}
    assert {id(m) for leaf in opt.leaf_optimizers for g in leaf.param_groups for m in g["params"]} == \
        {id(m) for m in mains}


def test_fp32_params_are_their_own_main_param():
    model, _, opt = make(torch.float32)
    assert all(p.main_param is p for p in model.parameters())
    backward(model)
    opt.step()
    assert opt.main_params_by_fqn() == {}
    assert all("main_param" not in s for s in opt.state_dict()["state"].values())   # +0 B for fp32
    assert all(opt.state[p] is opt.leaf_optimizers[0].state[p] or opt.state[p] is opt.leaf_optimizers[1].state[p]
               for p in model.parameters())


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64, torch.int32])
def test_other_dtypes_are_their_own_main_param(dtype):
    """As a plain optimizer takes them: no main param, stepped as they are (issue 42; the numerics
    against the plain optimizer are in tests/test_main_params_torch_contract.py)."""
    model = Net().to(torch.bfloat16)
    model.extra = nn.Parameter(torch.zeros(3, dtype=dtype), requires_grad=not dtype == torch.int32)
    opt = MainParamsOptimizer(torch.optim.AdamW(model.parameters()), model)
    assert model.extra.main_param is model.extra and any(p is model.extra for p in opt.leaf_optimizers[0].param_groups[0]["params"])
    assert model.body.weight.main_param.dtype == torch.float32


def test_param_not_in_model_is_rejected():
    stray = nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="not a parameter of the model"):
        MainParamsOptimizer(torch.optim.AdamW([stray]), Net())


def test_existing_state_moves_with_the_param_and_steps_as_a_plain_fp32_optimizer():
    """An optimizer that stepped before the wrap keeps its state: moved to the main params, its bf16
    moments cast to fp32 as torch's load_state_dict casts state to the param's dtype. The next step then
    equals a plain AdamW over fp32 copies loaded with the same state, bit for bit (before the cast, torch's
    kernels refused the bf16 moments next to fp32 params: 'expected dtype c10::BFloat16')."""
    torch.manual_seed(0)
    model = Net().to(torch.bfloat16)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        backward(model)
        adamw.step()
        adamw.zero_grad()
    old = {name: {k: v.clone() for k, v in adamw.state[p].items()} for name, p in model.named_parameters()}
    reference = Net()
    reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    plain.load_state_dict(copy.deepcopy(adamw.state_dict()))   # torch casts the moments, shares `step`
    opt = MainParamsOptimizer(adamw, model)
    for name, p in model.named_parameters():
        moved = adamw.state[p.main_param]
        assert p not in adamw.state and moved.keys() == old[name].keys()
        for key, value in old[name].items():
            assert torch.equal(moved[key], value.to(moved[key].dtype)), (name, key)
            assert moved[key].dtype == (value.dtype if key == "step" else torch.float32), (name, key)
    backward(model)
    for p, r in zip(model.parameters(), reference.parameters()):
        r.grad = p.grad.float()
    opt.step()
    plain.step()
    for (name, p), r in zip(model.named_parameters(), reference.parameters()):
        assert bit_mismatches(p.main_param, r)[0] == 0, name
        assert torch.equal(p, r.to(torch.bfloat16)), name


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
    torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 1e9)  # model grads
    opt.prepare_grads()   # Megatron's split step: the grads now live on the main params
    mains = [opt.main_param(p) for g in opt.param_groups for p in g["params"]]
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


def _trained(seed=0, steps=2):
    model, _, opt = make(seed=seed)
    for step in range(steps):
        backward(model, step)
        opt.step()
        opt.zero_grad()
    return model, opt


def test_state_dict_is_torch_layout_with_main_params_and_round_trips_exactly():
    model, opt = _trained()
    sd = opt.state_dict()
    names = [opt.fqn(p) for g in opt.param_groups for p in g["params"]]
    assert names == ["embed.weight", "body.bias", "lm_head.weight", "body.weight"]
    assert [g["params"] for g in sd["param_groups"]] == [[0, 1, 2], [3]]
    assert set(sd["state"][3]) == {"momentum_buffer", "main_param"}
    assert set(sd["state"][2]) == {"step", "exp_avg", "exp_avg_sq", "main_param"}
    assert all(sd["state"][i]["main_param"] is model.get_parameter(n).main_param for i, n in enumerate(names))
    mains = {n: sd["state"][i]["main_param"].clone() for i, n in enumerate(names)}

    model2, opt2 = _trained(seed=1, steps=1)
    opt2.load_state_dict(sd)
    for name, p in model2.named_parameters():      # main params restored, not rebuilt from bf16
        assert torch.equal(p.main_param, mains[name]), name
        assert torch.equal(opt2.state[p]["main_param"], mains[name])
    assert torch.equal(opt2.leaf_optimizers[1].state[model2.body.weight.main_param]["momentum_buffer"],
                       sd["state"][3]["momentum_buffer"])


def test_torch_state_dict_api_round_trips_nested_and_flattened():
    """get/set_optimizer_state_dict on one process: FQN keys, main params exact, and the call
    primes no step on an optimizer that already has state (its moments stay bit for bit)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    model, opt = _trained()
    moments = {id(p): {k: v.clone() for k, v in s.items() if torch.is_tensor(v)} for p, s in opt.state.items()}
    for flatten in (False, True):
        options = StateDictOptions(flatten_optimizer_state_dict=flatten)
        osd = get_optimizer_state_dict(model, opt, options=options)
        key = "state.body.weight.main_param" if flatten else None
        main = osd[key] if flatten else osd["state"]["body.weight"]["main_param"]
        assert main is model.body.weight.main_param
        for p, s in opt.state.items():
            for k, v in moments[id(p)].items():
                assert torch.equal(s[k], v), (opt.fqn(p), k)
        model2, opt2 = _trained(seed=1, steps=1)
        set_optimizer_state_dict(model2, opt2, osd, options=options)
        for name, p in model2.named_parameters():
            assert torch.equal(p.main_param, model.get_parameter(name).main_param), (flatten, name)
            for k, v in opt.state[model.get_parameter(name)].items():
                assert torch.equal(opt2.state[p][k], v), (flatten, name, k)


def test_plain_state_dict_rebuilds_main_params_with_warning():
    from npu_fsdp_patches.optim import drop_main_params
    model, opt = _trained(steps=1)
    sd = drop_main_params(opt.state_dict())
    assert all("main_param" not in s for s in sd["state"].values())
    assert all("main_param" in s for s in opt.state_dict()["state"].values())   # a copy was changed
    model2, _, opt2 = make(seed=1)
    with pytest.warns(UserWarning, match="fp32 tails"):
        opt2.load_state_dict(sd)
    assert all(torch.equal(p.main_param, p.float()) for p in model2.parameters())


def test_flattened_plain_state_into_the_wrapper_rebuilds_main_params_with_warning():
    """A plain optimizer's flattened state (no state.<fqn>.main_param keys): torch's unflattening
    asks the wrapper's state for its keys and hands back {} for main_param, which means absent."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    torch.manual_seed(0)
    plain_model = Net().to(torch.bfloat16)
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-3)
    backward(plain_model)
    plain.step()
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    flat = get_optimizer_state_dict(plain_model, plain, options=options)
    wrapped_model = Net().to(torch.bfloat16)
    wrapped_model.load_state_dict(plain_model.state_dict())
    opt = MainParamsOptimizer(torch.optim.AdamW(wrapped_model.parameters(), lr=1e-3), wrapped_model)
    if not FLAT_LOAD_FILLS_MISSING_KEYS:   # older torch's own unflattening fails (docs/main_params.md)
        with pytest.raises(KeyError, match=r"state\.embed\.weight\.main_param"):
            set_optimizer_state_dict(wrapped_model, opt, flat, options=options)
        return
    with pytest.warns(UserWarning, match="fp32 tails"):
        set_optimizer_state_dict(wrapped_model, opt, flat, options=options)
    assert all(torch.equal(p.main_param, p.float()) for p in wrapped_model.parameters())
    assert torch.equal(opt.state[wrapped_model.body.weight]["exp_avg"],
                       plain.state[plain_model.body.weight]["exp_avg"].float())


def test_legacy_layout_loads_with_its_main_params():
    """The earlier layout (FQN-keyed state + _mixed_precision_optimizer section) still loads."""
    model, opt = _trained()
    sd = opt.state_dict()
    names = [opt.fqn(p) for g in opt.param_groups for p in g["params"]]
    legacy = {"state": {names[i]: {k: v for k, v in s.items() if k != "main_param"} for i, s in sd["state"].items()},
              "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]],
              "_mixed_precision_optimizer": {"fp32_from_fp16_params": opt.main_params_by_fqn()}}
    model2, _, opt2 = make(seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt2.load_state_dict(legacy)
    for name, p in model2.named_parameters():
        assert torch.equal(p.main_param, model.get_parameter(name).main_param), name


def test_a_main_param_left_unloaded_is_rebuilt_from_the_loaded_model():
    """DCP with allow_partial_load leaves a template's main param as it was: the live main param
    still holding the fresh values. Loading must not keep it over the loaded model."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state
    model, opt = _trained()
    model2, _, opt2 = make(seed=1)    # a fresh build, as a resuming job has
    _init_optim_state(opt2)           # torch's priming step (lr=0), as get_state_dict runs it
    sd2 = opt2.state_dict()           # template: the live main params of opt2
    for i, s in opt.state_dict()["state"].items():   # "load" everything but main params
        for k, v in s.items():
            if k != "main_param" and torch.is_tensor(sd2["state"].get(i, {}).get(k)):
                sd2["state"][i][k].copy_(v)
    model2.load_state_dict(model.state_dict())
    with pytest.warns(UserWarning, match="fp32 tails"):
        opt2.load_state_dict(sd2)
    assert all(torch.equal(p.main_param, p.float()) for p in model2.parameters())


def test_partial_state_dict_raises_before_loading_anything():
    model, opt = _trained(steps=1)
    sd = opt.state_dict()
    sd["state"] = {i: dict(s) for i, s in sd["state"].items()}
    for i in (0, 3):   # embed.weight, body.weight
        del sd["state"][i]["main_param"]
    del sd["_mixed_precision_optimizer"]   # as torch's get_optimizer_state_dict leaves it
    model2, _, opt2 = make(seed=1)
    backward(model2, 5)
    opt2.step()
    before = ({k: v.clone() for k, v in opt2.main_params_by_fqn().items()},
              {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt2.state.items()})
    with pytest.raises(ValueError, match="body.weight, embed.weight"):
        opt2.load_state_dict(sd)
    for name, main in opt2.main_params_by_fqn().items():
        assert torch.equal(main, before[0][name])
    for p, s in opt2.state.items():
        assert all(torch.equal(v, before[1][id(p)][k]) for k, v in s.items())


def test_mismatched_groups_raise_before_loading():
    model, opt = _trained(steps=1)
    sd = opt.state_dict()
    sd["param_groups"][0]["params"] = [0, 1]
    with pytest.raises(ValueError, match=r"MainParamsOptimizer.load_state_dict: saved param group sizes \[2, 1\]"):
        opt.load_state_dict(sd)
    with pytest.raises(ValueError, match="has 4 param groups, the wrapped optimizers have 2"):
        opt.load_state_dict({"state": {}, "param_groups": sd["param_groups"] * 2})


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_and_pickles_step_bit_identically(how):
    """Issue 17 item 8: deepcopy/pickle work as on any torch optimizer, and the copy steps the same."""
    import copy
    import pickle
    model, opt = _trained()
    opt.register_step_post_hook(lambda *a: None)   # hooks are dropped, as torch's Optimizer drops them
    twin = copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))
    assert twin.model is not model and twin.leaf_optimizers[0] is not opt.leaf_optimizers[0]
    assert len(twin._optimizer_step_post_hooks) == 0
    for tm, m in zip(twin.model.parameters(), model.parameters()):
        assert tm.main_param is twin.main_param(tm) and tm.main_param is not m.main_param
    for step in (5, 6):
        for o in (opt, twin):
            backward(o.model, step)
            o.step()
            o.zero_grad()
    for (name, p), q in zip(model.named_parameters(), twin.model.parameters()):
        assert torch.equal(p, q) and torch.equal(p.main_param, q.main_param), name
        for k, v in opt.state[p].items():
            assert torch.equal(v, twin.state[q][k]), (name, k)
    nudged = twin.model.body.weight.main_param
    nudged.data.view(torch.int32)[0] += 1           # negative control: 1 ulp is visible
    assert not torch.equal(model.body.weight.main_param, nudged)


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


def test_model_loaded_after_wrapping_is_not_overwritten_by_torchs_priming_step():
    """Load the model, then set_optimizer_state_dict on a fresh wrapper: torch's priming step must
    not copy the main params (still those of the initial model) over the loaded model."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state
    loaded, _ = _trained(seed=1)
    model, _, opt = make()
    model.load_state_dict(loaded.state_dict())
    _init_optim_state(opt)                    # what get/set_optimizer_state_dict run first
    for (name, p), q in zip(model.named_parameters(), loaded.parameters()):
        assert torch.equal(p, q), name
        assert torch.equal(p.main_param, p.float()), name


def test_upstream_state_dict_moves_each_main_param_into_the_section_only():
    """docs/main_params.md §2.1: torch's flattened layout, the main params (the live tensors) only in the
    section, keyed by FQN; a plain optimizer is refused by name."""
    from npu_fsdp_patches.optim import upstream_state_dict
    model, _, wrapper = make(torch.bfloat16)
    backward(model)
    wrapper.step()
    sd = upstream_state_dict(model, wrapper)
    section = sd["_mixed_precision_optimizer"]["fp32_from_fp16_params"]
    assert sorted(section) == sorted(n for n, p in model.named_parameters() if p.dtype == torch.bfloat16)
    assert all(section[n] is wrapper.main_params_by_fqn()[n] for n in section)
    assert not [k for k in sd if k.endswith(".main_param")]
    assert any(k.startswith("state.") and k.endswith(".exp_avg") for k in sd)
    with pytest.raises(TypeError, match="expected a MainParamsOptimizer, got AdamW"):
        upstream_state_dict(model, torch.optim.AdamW(model.parameters()))


def test_the_cast_check_compares_device_meshes_by_value():
    from tests.distributed import run_ranks
    assert run_ranks("tests.multirank.main_params_cases:mesh_equal_by_value", 2) == [[True, True, False]] * 2
