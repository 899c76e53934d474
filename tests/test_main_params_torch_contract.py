"""MainParamsOptimizer against the plain optimizer through torch's optimizer contract (issue 42).

Every case of tests/main_params_contract.py (the project's own versions of torch's ``TestOptimRenewed``
families, plus the Optimizer API torch code uses) runs plain and wrapped, for AdamW, Adam and Muon over
bf16, fp16 and fp32 model params, and the two outcomes must be equal, tensors bit for bit; the cases
marked ``ranks`` also run on 2 gloo ranks over ``fully_shard``. What differs by design is a row of
docs/main_params.md#contract-with-torch-code, each tested below (``test_documented_*``).
"""
import copy

import pytest
import torch
from torch import nn

from npu_fsdp_patches.optim import MainParamsOptimizer
from tests import main_params_contract as contract
from tests.distributed import run_ranks
from tests.main_params_model import make
from tests.support import bit_mismatches

CONFIGS = [(kind, dtype) for kind in contract.KINDS for dtype in contract.DTYPES]
#: where the plain optimizer itself raises, so the wrapper must raise alike (torch's Muon takes no complex
#: params); any other case that fails on both sides fails the test: it would prove nothing
PLAIN_RAISES = {("muon", "complex_params"), ("muon", "complex_2d")}
#: FSDP2 (fully_shard) trains on CPU from torch 2.7 (docs/contributing.md#running-the-tests)
FSDP_ON_CPU = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 7)


@pytest.mark.parametrize("config", CONFIGS, ids=[f"{k}-{d}" for k, d in CONFIGS])
@pytest.mark.parametrize("name", list(contract.CASES))
def test_the_wrapper_matches_the_plain_optimizer(name, config):
    kind, dtype = config
    if not contract.available(kind):
        pytest.skip(f"torch.optim.{contract.KINDS[kind][0]} needs torch >= 2.9; this is torch {torch.__version__}")
    case = contract.CASES[name]
    plain = contract.outcome(case, contract.Run(kind, contract.DTYPES[dtype], wrapped=False))
    wrapped = contract.outcome(case, contract.Run(kind, contract.DTYPES[dtype], wrapped=True))
    diffs = contract.differences(plain, wrapped)
    assert not diffs, f"{name} ({case.torch_test}) differs plain vs wrapped:\n  " + "\n  ".join(diffs[:6])
    assert (plain[0] == "raises") == ((kind, name) in PLAIN_RAISES), f"the plain optimizer: {plain[:1]} {plain[1:]}"


def test_the_comparison_catches_one_ulp_and_a_changed_outcome():
    """Negative control of the comparison: one element one ulp off, and a raise against a success."""
    x = torch.randn(4, 3)
    y = x.clone()
    y.view(-1)[5] = torch.nextafter(y.view(-1)[5], torch.tensor(float("inf")))
    assert contract.differences(("ok", {"t": [x]}), ("ok", {"t": [y]}))
    assert contract.differences(("ok", {"t": [x]}), ("raises", "KeyError"))
    assert not contract.differences(("ok", {"t": [x]}), ("ok", {"t": [x.clone()]}))


RANK_CASES = [name for name, case in contract.CASES.items() if case.ranks]


@pytest.fixture(scope="module")
def two_ranks():
    if not FSDP_ON_CPU:
        pytest.skip(f"fully_shard trains on CPU from torch 2.7; this is torch {torch.__version__}")
    configs = [c for c in CONFIGS if contract.available(c[0])]
    return run_ranks("tests.multirank.main_params_contract_cases:case", 2, args={"configs": configs},
                     timeout=900)


@pytest.mark.parametrize("config", CONFIGS, ids=[f"{k}-{d}" for k, d in CONFIGS])
@pytest.mark.parametrize("name", RANK_CASES)
def test_the_wrapper_matches_the_plain_optimizer_on_two_ranks(two_ranks, name, config):
    if not contract.available(config[0]):
        pytest.skip(f"torch.optim.{contract.KINDS[config[0]][0]} needs torch >= 2.9")
    for rank, result in enumerate(two_ranks):
        diffs = result[f"{name}|{config[0]}|{config[1]}"]
        assert not diffs, f"rank {rank}: {name} differs plain vs wrapped over fully_shard:\n  " + "\n  ".join(diffs)


# ---- the rows where the wrapper differs by design (docs/main_params.md#contract-with-torch-code) ----
def _one_leaf(dtype=torch.bfloat16):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)).to(dtype)
    return model, MainParamsOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model)


def _step(model, opt):
    model(torch.randn(2, 4, dtype=next(model.parameters()).dtype)).float().pow(2).sum().backward()
    opt.step()


def test_documented_the_profiler_shows_the_leaf_steps_nested_in_the_wrapper_s():
    model, opt = _one_leaf()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _step(model, opt)
    names = [e.name for e in prof.events() if e.name.startswith("Optimizer.step#")]
    assert names == ["Optimizer.step#MainParamsOptimizer.step", "Optimizer.step#AdamW.step"]
    outer, inner = (next(e for e in prof.events() if e.name == n) for n in names)
    assert outer.time_range.start <= inner.time_range.start and inner.time_range.end <= outer.time_range.end


def test_documented_state_dict_adds_the_main_params_and_the_section():
    model, opt = _one_leaf()
    _step(model, opt)
    plain = torch.optim.AdamW(model.parameters())
    sd, plain_sd = opt.state_dict(), plain.state_dict()
    assert set(sd) - set(plain_sd) == {contract.SECTION}
    assert all(entry["main_param"] is opt.main_param(p) for entry, p in zip(sd["state"].values(), model.parameters()))


def test_documented_repr_names_the_wrapper_and_prints_each_leaf():
    _, opt = _one_leaf()
    text = repr(opt)
    assert text.startswith("MainParamsOptimizer with fp32 main params of 4 bf16/fp16 param(s) over (\nAdamW (")
    assert repr(opt.leaf_optimizers[0]) in text


def test_documented_a_new_group_appended_gets_its_defaults_and_main_params():
    """torch appends the dict as is (a group without its defaults then fails at step); the wrapper must make
    the group's main params, so it adds it as add_param_group does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)).to(torch.bfloat16)
    opt = MainParamsOptimizer(torch.optim.AdamW(model[0].parameters()), model)
    opt.param_groups.append({"params": list(model[1].parameters()), "lr": 0.5})
    assert opt.param_groups[1]["betas"] == (0.9, 0.999) and opt.param_groups[1]["lr"] == 0.5
    assert all(p.main_param.dtype == torch.float32 for p in model[1].parameters())
    plain = torch.optim.AdamW(nn.Linear(2, 2).parameters())
    plain.param_groups.append({"params": [nn.Parameter(torch.ones(2))], "lr": 0.5})
    assert "betas" not in plain.param_groups[1]


def test_documented_a_tensor_key_that_is_no_model_param_is_refused_at_once():
    """A plain optimizer takes it and fails later, in state_dict(); the wrapper refuses it naming why."""
    model, opt = _one_leaf()
    with pytest.raises(KeyError, match="fp32 main param of '0.weight'"):
        opt.state[opt.main_param(model[0].weight)] = {}
    plain = torch.optim.AdamW(model.parameters())
    plain.state[torch.zeros(1)] = {}
    with pytest.raises(KeyError):
        plain.state_dict()


def test_documented_defaults_and_groups_over_several_leaves_refuse_what_cannot_take_effect():
    _, _, opt = make()
    with pytest.raises(TypeError, match="defaults is read-only over several leaf optimizers"):
        opt.defaults["lr"] = 1.0
    with pytest.raises(ValueError, match="cannot tell which one takes the new group"):
        opt.add_param_group({"params": []})
    with pytest.raises(TypeError, match="removing, replacing or reordering groups is not supported"):
        opt.param_groups.pop()


def test_documented_state_keys_that_are_no_param_cannot_go_into_the_flattened_layout():
    """Over hyper-parallel DTensors with several leaves the state dict is flattened (``state.<fqn>.<key>``):
    a key that is no param has no place there, so saving warns naming it."""
    model, _, opt = make()
    opt.state["note"] = 1
    flattened = {"state.body.weight.exp_avg": torch.zeros(1), "param_groups.body.weight.lr": 0.1}
    with pytest.warns(UserWarning, match=r"no place for the optimizer state keys that are no param \(\[\"'note'\"\]\)"):
        assert opt._with_non_param_state(dict(flattened)) == flattened


@pytest.mark.skipif(not FSDP_ON_CPU, reason=f"the one-graph compiled step needs torch >= 2.7; this is torch {torch.__version__}")
def test_a_compiled_step_over_float64_and_complex_params_equals_torch_s_compiled_step():
    """float64 and complex params are their own main params: the one-graph compiled step hands them their
    grads in their own dtype, so it equals torch's own compiled AdamW over them, bit for bit."""
    def run(wrap):
        torch.manual_seed(0)
        model = nn.Module()
        model.d = nn.Parameter(torch.randn(3, dtype=torch.float64))
        model.c = nn.Parameter(torch.randn(2, dtype=torch.complex64))
        leaf = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
        opt = MainParamsOptimizer(leaf, model) if wrap else leaf
        step = torch.compile(opt.step, backend="aot_eager")
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            step()
        return [p.detach().clone() for p in model.parameters()]
    for plain, wrapped in zip(run(False), run(True)):
        assert bit_mismatches(plain, wrapped) == (0, "")
