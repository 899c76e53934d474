"""Every entry point that changes user state is validate-then-commit: with the N-th internal write
made to fail, for every N the call reaches, the objects the user handed over are identity- and
bit-equal to before (tests/fault_injection.py; docs/design.md#validate-then-commit).

Adding an entry point is one line of ENTRIES.
"""
import copy
import functools
import warnings

import pytest
import torch
from torch import nn

from npu_fsdp_patches.optim import FusedAdam, MainParamsOptimizer, apply_model_init_dtype
from npu_fsdp_patches.optim.main_params_checkpoint import load_checkpoint, save_checkpoint
from npu_fsdp_patches.optim.muon_routing import OptimizerChain, build_muon_adamw, split_muon_adamw_params
from npu_fsdp_patches.optim._rollback import Rollback
from tests.fault_injection import Entry, check_entry
from tests.main_params_model import Net, backward, make, make_chain
from tests.core_demo import late_demo_site
from tests.support import run_case
from tests.torch_versions import HAS_MUON

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


# ---- setups --------------------------------------------------------------------------------------
def _trained(seed=0, steps=1, dtype=torch.bfloat16):
    """A Muon + AdamW chain (momentum SGD without torch.optim.Muon) wrapped and stepped (a copy of
    one trained once: setups run once per injected write)."""
    return copy.deepcopy(_trained_once(seed, steps, dtype))


@functools.lru_cache(maxsize=None)
def _trained_once(seed, steps, dtype):
    model, chain, wrapper = make(dtype, seed=seed)
    for s in range(steps):
        backward(model, seed + s)
        wrapper.step()
        wrapper.zero_grad()
    return model, chain, wrapper


def _plain(extra=None, seed=0, dtype=torch.bfloat16):
    """A bf16 (or ``dtype``) model and an AdamW over its params (plus ``extra``), stepped once."""
    torch.manual_seed(seed)
    model = Net().to(dtype)
    params = list(model.parameters()) + list(extra or [])
    opt = torch.optim.AdamW(params, lr=1e-2)
    backward(model)
    opt.step()
    return {"model": model, "optimizer": opt}


def _with_f64():
    model = Net().to(torch.bfloat16)
    model.extra = nn.Parameter(torch.ones(3, dtype=torch.float64))
    return {"model": model, "optimizer": torch.optim.AdamW(model.parameters())}


def _inner_wrapper(steps=3):
    """A bf16 model and a MainParamsOptimizer over AdamW that stepped ``steps`` times (issue 42)."""
    handed = _plain()
    model = handed["model"]
    inner = MainParamsOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model)
    for s in range(steps):
        backward(model, s)
        inner.step()
        inner.zero_grad()
    return {"model": model, "optimizer": inner}


def _master_leaf(make, steps=1):
    """A bf16 model and a leaf that keeps fp32 masters of its own, stepped ``steps`` times."""
    torch.manual_seed(0)
    model = Net().to(torch.bfloat16)
    leaf = make(list(model.parameters()))
    for s in range(steps):
        backward(model, s)
        leaf.step()
        leaf.zero_grad()
    return {"model": model, "optimizer": leaf}


def _veomni_master(cls_name):
    from tests.support import load_fixture_module
    return getattr(load_fixture_module("veomni_master_fp32/master_fp32_adamw.py"), cls_name)


def _edit_through_views(h):
    """Writes through a wrapper's views (a group's lr, a state entry, a key that is no param), undone from
    a Rollback taken of the wrapper itself: it records what the views show (issue 42)."""
    wrapper, w = h["wrapper"], h["model"].body.weight
    rollback = Rollback()
    rollback.optimizer(wrapper)
    try:
        wrapper.param_groups[0]["lr"] = 0.5
        wrapper.state["note"] = 1
        wrapper.state[w]["exp_avg_sq"] = torch.zeros(1)
        del wrapper.state[w]
        raise ValueError("refused after the writes")
    except BaseException:
        rollback.restore()
        raise


def _add_group(h):
    h["wrapper"].add_param_group({"params": [h["model"].lm_head.weight], "lr": 0.5})


def _one_leaf_wrapper(params_of=lambda m: [m.embed.weight, m.body.weight, m.body.bias]):
    """A wrapper over one AdamW that holds some of the model's params, stepped once."""
    torch.manual_seed(0)
    model = Net().to(torch.bfloat16)
    leaf = torch.optim.AdamW(params_of(model), lr=1e-2)
    wrapper = MainParamsOptimizer(leaf, model)
    backward(model)
    wrapper.step()
    return {"model": model, "optimizer": leaf, "wrapper": wrapper}


def _with_note(sd):
    sd["state"]["note"] = {"epoch": 3}


def _fresh_chain():
    """An unwrapped Muon + AdamW chain over a bf16 model, with state from one step."""
    model, chain = make_chain(torch.bfloat16)
    backward(model)
    chain.step()
    return {"model": model, "optimizer": chain}


class CachingAdamW(torch.optim.AdamW):
    """Keeps its params outside state/param_groups: wrapping must refuse it (stale references)."""

    def __init__(self, params, **kw):
        super().__init__(params, **kw)
        self.cache = [p for g in self.param_groups for p in g["params"]]


class ResettingChain(OptimizerChain):
    """A chain whose reset_optimizer_parameters reassigns its own cache."""

    def reset_optimizer_parameters(self, mapping):
        self.mapping = dict(mapping)


def _stale():
    handed = _plain()
    handed["optimizer"] = CachingAdamW(handed["model"].parameters())
    return handed


def _reset_then_stale():
    model = Net().to(torch.bfloat16)
    params = list(model.parameters())
    chain = ResettingChain({"a": torch.optim.AdamW(params[:2]), "b": CachingAdamW(params[2:])})
    chain.mapping = {}
    return {"model": model, "optimizer": chain}


def _loaded(source, **kw):
    """A trained wrapper and the state dict of another run (``source(state_dict)`` edits it)."""
    model, chain, wrapper = _trained(seed=0)
    _, _, other = _trained(seed=1, steps=2)
    state_dict = copy.deepcopy(other.state_dict())
    source(state_dict)
    return {"model": model, "optimizer": chain, "wrapper": wrapper, "state_dict": state_dict}


def _second_main_param_wrong_shape(sd):
    with_main = [k for k in sorted(sd["state"]) if "main_param" in sd["state"][k]]
    sd["state"][with_main[1]]["main_param"] = torch.zeros(7)


def _plain_state(sd):
    for entry in sd["state"].values():
        entry.pop("main_param", None)


def _torch_api():
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    model, chain, wrapper = _trained(seed=0)
    other_model, _, other = _trained(seed=1, steps=2)
    osd = copy.deepcopy(get_optimizer_state_dict(other_model, other))
    return {"model": model, "optimizer": chain, "wrapper": wrapper, "state_dict": osd}


def _set_optimizer_state_dict(h):
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
    set_optimizer_state_dict(h["model"], h["wrapper"], h["state_dict"])


def _checkpoint(tmp, dtype=torch.bfloat16, layout="torch"):
    def setup():
        model, chain, wrapper = _trained(seed=0, dtype=dtype)
        path = str(tmp / f"ckpt_{layout}")
        if not (tmp / f"ckpt_{layout}").exists():
            other_model, _, other = _trained(seed=1, steps=2)
            save_checkpoint(path, other_model, other, layout=layout)
        return {"model": model, "optimizer": chain, "wrapper": wrapper, "checkpoint": path}
    return setup


def _fused(seed=0, dtype=torch.bfloat16, extra=None):
    torch.manual_seed(seed)
    params = [nn.Parameter(torch.randn(4, 3).to(dtype)), nn.Parameter(torch.randn(5).to(dtype))]
    params += list(extra or [])
    opt = FusedAdam(params, lr=1e-2, master_weights=True)
    for p in params:
        p.grad = torch.randn_like(p)
    if not extra:
        opt.step()
    return params, opt


def _fused_load():
    params, opt = _fused(0)
    _, other = _fused(1)
    other.step()
    return {"params": params, "optimizer": opt, "state_dict": copy.deepcopy(other.state_dict())}


def _fused_bad_dtype(dtype):
    def setup():
        params, opt = _fused(0, extra=[nn.Parameter(torch.ones(3, dtype=dtype))])
        for p in params:
            p.grad = torch.ones_like(p)
        return {"params": params, "optimizer": opt}
    return setup


def _into_fp32_model():
    """A bf16 run's state dict (with fp32 main params) and a trained fp32-model wrapper."""
    model, chain, wrapper = _trained(seed=0, dtype=torch.float32)
    _, _, other = _trained(seed=1, steps=2)
    return {"model": model, "optimizer": chain, "wrapper": wrapper,
            "state_dict": copy.deepcopy(other.state_dict())}


def _reordered(named):
    """A wrapper over a model declaring its params in another order than the saved run's; with
    ``named`` the state dict keeps its RFC section, whose names load it by name (else: refused)."""
    def setup():
        model, chain, wrapper = _trained(seed=0)
        sd = copy.deepcopy(_trained(seed=1, steps=2)[2].state_dict())
        group = sd["param_groups"][0]
        group["params"] = group["params"][::-1]
        if not named:
            del sd["_mixed_precision_optimizer"]
        return {"model": model, "optimizer": chain, "wrapper": wrapper, "state_dict": sd}
    return setup


def _wrap(h):
    MainParamsOptimizer(h["optimizer"], h["model"])


def _load(h):
    h["wrapper"].load_state_dict(h["state_dict"])


def _load_checkpoint(h):
    load_checkpoint(h["checkpoint"], h["model"], h["wrapper"])


def entries(tmp):
    return [
        Entry("wrap AdamW", _plain, _wrap),
        Entry("wrap AdamW over fp16 params (their grads widened)", lambda: _plain(dtype=torch.float16), _wrap),
        Entry("wrap Muon+AdamW chain", _fresh_chain, _wrap),
        Entry("wrap: float64 param among bf16", _with_f64, _wrap),
        Entry("wrap: a param twice in one group", lambda: (lambda m: {"model": m, "optimizer": torch.optim.AdamW(
            [m.body.weight, m.body.weight, m.body.bias])})(Net().to(torch.bfloat16)), _wrap),
        Entry("wrap: a MainParamsOptimizer that stepped 3 times", _inner_wrapper, _wrap, TypeError),
        Entry("wrap: a chain holding a MainParamsOptimizer", lambda: (lambda h: {
            "model": h["model"], "optimizer": OptimizerChain({"inner": h["optimizer"]})})(_inner_wrapper()),
              _wrap, TypeError),
        Entry("wrap: our FusedAdam(master_weights=True)", lambda: _master_leaf(
            lambda ps: FusedAdam(ps, lr=1e-2, master_weights=True)), _wrap, TypeError),
        Entry("wrap: veomni MasterFP32AdamW, stepped", lambda: _master_leaf(
            lambda ps: _veomni_master("MasterFP32AdamW")(ps, lr=1e-2)), _wrap, TypeError),
        Entry("wrap: veomni FullFP32AdamW, before its first step", lambda: _master_leaf(
            lambda ps: _veomni_master("FullFP32AdamW")(ps, lr=1e-2), steps=0), _wrap, TypeError),
        Entry("wrap: param not in the model", lambda: _plain([nn.Parameter(torch.ones(2, dtype=torch.bfloat16))]),
              _wrap, ValueError),
        Entry("wrap: param twice", lambda: (lambda m: {"model": m, "optimizer": [
            torch.optim.AdamW([m.body.weight]), torch.optim.AdamW([m.body.weight, m.body.bias])]})(
                Net().to(torch.bfloat16)), _wrap, ValueError),
        Entry("wrap: stale reference", _stale, _wrap, TypeError),
        Entry("wrap: chain reset, then stale reference", _reset_then_stale, _wrap, TypeError),
        Entry("load_state_dict", lambda: _loaded(lambda sd: None), _load),
        Entry("load_state_dict: a state key that is no param", lambda: _loaded(_with_note), _load),
        Entry("writes through the views, rolled back", lambda: _loaded(lambda sd: None), _edit_through_views,
              ValueError),
        Entry("add_param_group", _one_leaf_wrapper, _add_group),
        Entry("add_param_group: a param already wrapped", lambda: _one_leaf_wrapper(
            lambda m: [m.embed.weight, m.body.weight, m.lm_head.weight]), _add_group, ValueError),
        Entry("load_state_dict: plain optimizer's state", lambda: _loaded(_plain_state), _load),
        Entry("load_state_dict: 2nd main_param wrong shape", lambda: _loaded(_second_main_param_wrong_shape),
              _load, ValueError),
        Entry("load_state_dict: bf16 run into an fp32 model", _into_fp32_model, _load),
        Entry("load_state_dict: another param order", _reordered(False), _load, ValueError),
        Entry("load_state_dict: another param order, named by the section", _reordered(True), _load),
        Entry("set_optimizer_state_dict (torch API)", _torch_api, _set_optimizer_state_dict),
        Entry("load_checkpoint", _checkpoint(tmp), _load_checkpoint),
        Entry("load_checkpoint: bf16 run into an fp32 model", _checkpoint(tmp, torch.float32), _load_checkpoint),
        Entry("load_checkpoint: upstream's layout", _checkpoint(tmp, layout="upstream"), _load_checkpoint),
        Entry("FusedAdam.load_state_dict", _fused_load, lambda h: h["optimizer"].load_state_dict(h["state_dict"])),
        Entry("FusedAdam.step: float64 param", _fused_bad_dtype(torch.float64),
              lambda h: h["optimizer"].step(), RuntimeError),
        Entry("FusedAdam.step: complex param", _fused_bad_dtype(torch.complex64),
              lambda h: h["optimizer"].step(), RuntimeError),
    ]


NAMES = [e.name for e in entries(None)]


@pytest.mark.parametrize("mode", ["after", "before"])
@pytest.mark.parametrize("name", NAMES)
def test_a_failed_call_changes_nothing(name, mode, tmp_path):
    entry = next(e for e in entries(tmp_path) if e.name == name)
    result = check_entry(entry, mode)
    assert result.writes > 0 or entry.raises is not None


def test_the_harness_detects_a_half_done_change():
    """Negative control: a call that writes twice and has no rollback is caught at write 1."""
    def half_done(h):
        with torch.no_grad():
            h["model"].body.weight.copy_(torch.zeros_like(h["model"].body.weight))
            h["model"].body.bias.copy_(torch.zeros_like(h["model"].body.bias))

    with pytest.raises(AssertionError, match="write 1 failed.*changed"):
        check_entry(Entry("half done", _plain, half_done))


def test_the_harness_detects_a_one_ulp_change():
    """Negative control: one element one ulp off is a difference."""
    def one_ulp(h):
        w = h["model"].body.weight
        with torch.no_grad():
            w.view(torch.int16).view(-1)[0] += 1
        raise ValueError("refused")

    with pytest.raises(AssertionError, match="changed"):
        check_entry(Entry("one ulp", _plain, one_ulp, ValueError))


def test_the_harness_detects_a_swallowed_fault():
    def swallow(h):
        try:
            with torch.no_grad():
                h["model"].body.weight.copy_(torch.zeros_like(h["model"].body.weight))
        except RuntimeError:
            pass

    with pytest.raises(AssertionError, match="call succeeded"):
        check_entry(Entry("swallow", _plain, swallow))


# ---- the plugin's own entry points: apply, revert, on import, late detection ----------------------
# They run where the plugin is active, in a child with the core_demo fixtures (tests/children/plugin_faults.py,
# one Entry line each); late detection needs a fresh process per injected write.
PLUGIN_ENTRIES = {"apply: two targets in one module": 2, "revert: two targets in one module": 2,
                  "apply as the module is imported": 3}   # name: target writes (demo_child adds Child.run)


@pytest.mark.parametrize("mode", ["after", "before"])
@pytest.mark.parametrize("name", PLUGIN_ENTRIES)
def test_a_failed_apply_or_revert_changes_no_target(name, mode, demo_site):
    writes = run_case("tests.children.plugin_faults:check", args={"name": name, "mode": mode},
                      paths=[demo_site], env={"NPU_FSDP_PATCHES_MATRIX": str(demo_site / "demo_matrix.yaml")})
    assert writes == PLUGIN_ENTRIES[name]   # each target write failed in turn, before and after it is made


@pytest.mark.parametrize("mode", ["after", "before"])
def test_a_failed_late_detection_changes_no_target(mode, tmp_path):
    site, late = late_demo_site(tmp_path)

    def run(n):
        out = run_case("tests.children.plugin_faults:late_once", args={"late_site": str(late), "n": n, "mode": mode},
                       paths=[site], env={"NPU_FSDP_PATCHES_MATRIX": str(site / "demo_matrix.yaml")})
        return out["fired"], out["error"]

    entry = Entry("late detection", dict, lambda h: None)
    assert check_entry(entry, mode, run=run).writes == 3   # greet, Engine.run, Child.run (demo_child)


def test_the_harness_detects_a_half_applied_module(demo_site):
    """Negative control for the plugin entries: a revert that raises after restoring one of two targets,
    with no rollback, is caught (the registry's reinstall disabled)."""
    with pytest.raises(AssertionError, match="changed"):
        run_case("tests.children.plugin_faults:check_without_rollback", paths=[demo_site],
                 env={"NPU_FSDP_PATCHES_MATRIX": str(demo_site / "demo_matrix.yaml")})
