"""Loads that do not fit say why, loads that carry fp32 state use it, and FusedAdam refuses what
it cannot step (issue 29; docs/main_params.md#loading-checks)."""
import copy
import warnings

import pytest
import torch
from torch import nn

from npu_fsdp_patches.optim import FusedAdam, MainParamsOptimizer
from npu_fsdp_patches.optim.main_params_checkpoint import load_checkpoint, save_checkpoint
from tests.main_params_model import backward, make
from tests.torch_versions import FLAT_LOAD_FILLS_MISSING_KEYS


def _wrapped(order, dtypes, shapes, seed=0):
    """A module declaring params ``order`` (names), an AdamW over them, wrapped and stepped."""
    torch.manual_seed(seed)
    module = nn.Module()
    for name in order:
        setattr(module, name, nn.Parameter(torch.randn(shapes[name]).to(dtypes[name])))
    wrapper = MainParamsOptimizer(torch.optim.AdamW(list(module.parameters()), lr=1e-2), module)
    for p in module.parameters():
        p.grad = torch.randn_like(p)
    wrapper.step()
    return module, wrapper


DTYPES = {"a": torch.bfloat16, "w": torch.bfloat16, "v": torch.float32}


@pytest.mark.parametrize("shapes", [{"a": (4, 3), "w": (5,), "v": (2, 2)},   # shapes tell
                                    {"a": (3,), "w": (3,), "v": (3,)}],       # only main params tell
                         ids=["shapes differ", "same shapes"])
def test_another_param_order_is_named_as_such(shapes):
    """Without the RFC section (which names the bf16 params, see the next tests) saved params map by
    position, and an order that does not fit is refused as such."""
    _, saved = _wrapped("awv", DTYPES, shapes)
    module, target = _wrapped("avw", DTYPES, shapes, seed=1)
    before = copy.deepcopy(target.state_dict())
    unnamed = {k: v for k, v in copy.deepcopy(saved.state_dict()).items() if k != "_mixed_precision_optimizer"}
    with pytest.raises(ValueError, match="another order") as info:
        target.load_state_dict(unnamed)
    assert "incomplete" not in str(info.value)
    assert "'v'" in str(info.value) or "'w'" in str(info.value)
    after = target.state_dict()
    for k, entry in before["state"].items():
        for name, value in entry.items():
            assert torch.equal(value, after["state"][k][name]), (k, name)


def test_a_wrong_shape_is_named_before_anything_is_loaded():
    shapes = {"a": (4, 3), "w": (5,), "v": (2, 2)}
    _, saved = _wrapped("awv", DTYPES, shapes)
    _, target = _wrapped("awv", DTYPES, {**shapes, "w": (6,)}, seed=1)
    with pytest.raises(ValueError, match=r"'w' has shape \(6,\), its saved state \(5,\)"):
        target.load_state_dict(saved.state_dict())


def _legacy(wrapper, module):
    """The earlier layout: state and groups keyed by FQN, main params in their own section."""
    sd = wrapper.state_dict()
    fqns = [n for n, _ in module.named_parameters()]
    mains = {fqns[k]: entry.pop("main_param") for k, entry in sd["state"].items() if "main_param" in entry}
    return {"state": {fqns[k]: v for k, v in sd["state"].items()},
            "param_groups": [{**g, "params": [fqns[i] for i in g["params"]]} for g in sd["param_groups"]],
            "_mixed_precision_optimizer": {"fp32_from_fp16_params": mains}}


def test_a_state_dict_keyed_by_name_loads_by_name_in_another_order():
    shapes = {"a": (4, 3), "w": (5,), "v": (2, 2)}
    src_module, saved = _wrapped("awv", DTYPES, shapes)
    module, target = _wrapped("avw", DTYPES, shapes, seed=1)
    target.load_state_dict(_legacy(saved, src_module))
    for name in "aw":
        assert torch.equal(getattr(module, name).main_param, getattr(src_module, name).main_param), name
    for name in "awv":
        src, dst = saved.state[getattr(src_module, name)], target.state[getattr(module, name)]
        assert torch.equal(src["exp_avg"], dst["exp_avg"]), name


def test_bf16_state_into_an_fp32_model_resumes_from_the_fp32_main_params():
    model16, _, wrapper16 = make(torch.bfloat16, seed=0)
    backward(model16)
    wrapper16.step()
    model32, _, wrapper32 = make(torch.float32, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wrapper32.load_state_dict(copy.deepcopy(wrapper16.state_dict()))
    for (name, p16), (_, p32) in zip(model16.named_parameters(), model32.named_parameters()):
        assert torch.equal(p32, p16.main_param), name   # the fp32 master, not bf16-rounded weights
        assert not torch.equal(p32, p16.float()), name   # (it is not the rounded value: test can fail)


def test_bf16_checkpoint_into_an_fp32_model_resumes_from_the_fp32_main_params(tmp_path):
    model16, _, wrapper16 = make(torch.bfloat16, seed=0)
    backward(model16)
    wrapper16.step()
    save_checkpoint(str(tmp_path / "ck"), model16, wrapper16)
    model32, _, wrapper32 = make(torch.float32, seed=1)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(process group|ProcessGroup).*")
        assert load_checkpoint(str(tmp_path / "ck"), model32, wrapper32) == "main_params"
    for (name, p16), (_, p32) in zip(model16.named_parameters(), model32.named_parameters()):
        assert torch.equal(p32, p16.main_param), name


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64])
def test_fused_adam_refuses_unsteppable_dtypes_before_any_write(dtype):
    good = nn.Parameter(torch.ones(3))
    bad = nn.Parameter(torch.ones(2, dtype=dtype))
    opt = FusedAdam([good, bad], lr=0.1)
    for p in (good, bad):
        p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match=rf"param 1 of param group 0 .*dtype={dtype}.*nothing was updated"):
        opt.step()
    assert opt.param_groups[0]["step"] == 0 and not opt.state
    assert torch.equal(good, torch.ones(3))


@pytest.mark.parametrize("shapes", [{"a": (4, 3), "w": (5,), "v": (2, 2)}, {"a": (3,), "w": (3,), "v": (3,)}],
                         ids=["shapes differ", "same shapes"])
def test_with_the_rfc_section_another_param_order_loads_by_name(shapes):
    src_module, saved = _wrapped("awv", DTYPES, shapes)
    module, target = _wrapped("avw", DTYPES, shapes, seed=1)
    target.load_state_dict(copy.deepcopy(saved.state_dict()))
    module.load_state_dict(src_module.state_dict())
    _assert_loaded_by_name(src_module, saved, module, target, "awv")


def _assert_loaded_by_name(src_module, saved, module, target, names):
    for name in names:
        src, dst = getattr(src_module, name), getattr(module, name)
        assert torch.equal(dst.main_param, src.main_param), f"{name}: main param of another param"
        assert torch.equal(target.state[dst]["exp_avg"], saved.state[src]["exp_avg"]), f"{name}: moments"
        assert torch.equal(dst, src), f"{name}: model param not the cast main param"


@pytest.mark.parametrize("via", ["memory", "torch.save"])
def test_same_shape_params_declared_in_another_order_load_by_the_sections_names(tmp_path, via):
    """Issue 42: state_dict() names every bf16 param in its _mixed_precision_optimizer section, so a
    model declaring same-shape params in another order gets each param's own moments and main param
    (it got its neighbour's, silently, when loads went by position)."""
    dtypes = {"a": torch.bfloat16, "b": torch.bfloat16, "v": torch.float32}
    shapes = {"a": (3, 4), "b": (3, 4), "v": (2,)}
    src_module, saved = _wrapped("abv", dtypes, shapes)
    module, target = _wrapped("bav", dtypes, shapes, seed=1)
    sd = saved.state_dict()
    if via == "torch.save":
        torch.save(sd, tmp_path / "opt.pt")
        sd = torch.load(tmp_path / "opt.pt", weights_only=True)
    target.load_state_dict(sd)
    module.load_state_dict({n: p for n, p in src_module.state_dict().items()})
    _assert_loaded_by_name(src_module, saved, module, target, "abv")


def test_names_cannot_place_two_unnamed_params_so_the_load_is_refused():
    """The section names bf16 params only: when names show another order and two fp32 params are left
    unnamed, their order cannot be told, and the load is refused naming them before any write."""
    dtypes = {"a": torch.bfloat16, "b": torch.bfloat16, "u": torch.float32, "v": torch.float32}
    shapes = {"a": (3,), "b": (3,), "u": (3,), "v": (3,)}
    _, saved = _wrapped("abuv", dtypes, shapes)
    module, target = _wrapped("bavu", dtypes, shapes, seed=1)
    before = copy.deepcopy(target.state_dict())
    with pytest.raises(ValueError, match=r"'u'.*'v'|'v'.*'u'") as info:
        target.load_state_dict(saved.state_dict())
    assert "Nothing was loaded" in str(info.value)
    after = target.state_dict()
    for k, entry in before["state"].items():
        for name, value in entry.items():
            assert torch.equal(value, after["state"][k][name]), (k, name)


def test_a_param_without_optimizer_state_is_no_missing_main_param(tmp_path):
    """torch's layout stores ``main_param`` with a param's optimizer state: a bf16 param that never got a
    grad (an unused expert) has neither, so such a checkpoint must load (it was refused as partial). Written
    by hand: older torch's get_optimizer_state_dict cannot serve an optimizer whose state is partial."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    module, wrapper = _wrapped("aw", DTYPES, {"a": (4, 3), "w": (5,)})
    osd = get_optimizer_state_dict(module, wrapper)
    del osd["state"]["w"]   # as saved while w had no state
    dcp.save({"model": module.state_dict(), "optimizer": osd}, checkpoint_id=str(tmp_path / "ck"))
    target_module, target = _wrapped("aw", DTYPES, {"a": (4, 3), "w": (5,)}, seed=1)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(process group|ProcessGroup).*")
        assert load_checkpoint(str(tmp_path / "ck"), target_module, target) == "main_params"
    assert torch.equal(target_module.a.main_param, module.a.main_param)
    assert torch.equal(target_module.w.main_param, module.w.float())


def _bf16_pair(seed, *, step):
    """A wrapped AdamW over two bf16 params, ``stepped`` and ``idle``; with ``step``, after one step in
    which only ``stepped`` had a grad (``idle`` has no state yet)."""
    torch.manual_seed(seed)
    module = nn.Module()
    module.stepped = nn.Parameter(torch.randn(3).bfloat16())
    module.idle = nn.Parameter(torch.randn(2).bfloat16())
    wrapper = MainParamsOptimizer(torch.optim.AdamW(list(module.parameters()), lr=1e-2), module)
    if step:
        module.stepped.grad = torch.randn(3).bfloat16()
        wrapper.step()
    return module, wrapper


@pytest.mark.skipif(not FLAT_LOAD_FILLS_MISSING_KEYS,
                    reason=f"torch {torch.__version__} raises KeyError in its own flattened load of a "
                           f"param without state, for any optimizer")
def test_a_flattened_load_of_a_param_without_state_yet_loads():
    """torch's flattened load (strict=False) hands the moments the checkpoint lacks ``{}``, one per key
    of the template; the wrapper took them for saved state and refused, and torch's own optimizer would
    step on them (found by tests/test_generated_cases.py)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    module, wrapper = _bf16_pair(0, step=True)
    options = StateDictOptions(flatten_optimizer_state_dict=True, strict=False)
    saved = get_optimizer_state_dict(module, wrapper, options=options)
    target_module, target = _bf16_pair(1, step=False)
    set_optimizer_state_dict(target_module, target, copy.deepcopy(saved), options=options)
    assert torch.equal(target.main_param(target_module.stepped), wrapper.main_param(module.stepped))
    assert target_module.idle not in target.state
    for key, value in wrapper.state[module.stepped].items():
        assert torch.equal(target.state[target_module.stepped][key], value), key
    for p in target_module.parameters():
        p.grad = torch.ones_like(p)
    target.step()   # no {} left as a moment


@pytest.mark.parametrize("through", ["state_dict", "torch_api"])
def test_the_main_param_of_a_param_its_leaf_keeps_no_state_for_is_saved(through):
    """SGD without momentum keeps no state, yet steps its params: the fp32 main param of such a bf16
    param is its only state. It was left out of the per-param entries, so a resume rebuilt it from the
    bf16 model param, silently dropping its fp32 tail (found by tests/test_generated_cases.py)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    def build(seed):
        torch.manual_seed(seed)
        module = nn.Module()
        module.adamw = nn.Parameter(torch.randn(3).bfloat16())
        module.sgd = nn.Parameter(torch.randn(2).bfloat16())
        leaves = [torch.optim.AdamW([module.adamw], lr=1e-2), torch.optim.SGD([module.sgd], lr=1e-3)]
        return module, MainParamsOptimizer(leaves, module)

    module, wrapper = build(0)
    for _ in range(2):
        for p in module.parameters():
            p.grad = torch.randn_like(p)
        wrapper.step()
    main = wrapper.main_param(module.sgd)
    assert not torch.equal(main, module.sgd.float())   # it has an fp32 tail: the test can fail
    target_module, target = build(1)
    with torch.no_grad():
        for dst, src in zip(target_module.parameters(), module.parameters()):
            dst.copy_(src)
    if through == "state_dict":
        target.load_state_dict(copy.deepcopy(wrapper.state_dict()))
    else:
        options = StateDictOptions(strict=False)
        set_optimizer_state_dict(target_module, target,
                                 copy.deepcopy(get_optimizer_state_dict(module, wrapper, options=options)),
                                 options=options)
    assert torch.equal(target.main_param(target_module.sgd), main)
    assert torch.equal(target.main_param(target_module.adamw), wrapper.main_param(module.adamw))
