"""Writes to the model between steps are honoured (issue 42; docs/main_params.md#contract-with-torch-code).

A plain optimizer keeps a rewind (``model.load_state_dict``), weight clipping (``p.clamp_()``) and
``p.data = t``; so does the wrapper: the next step re-derives each written param's main param from the
model, element by element, keeping the fp32 tail of every element the write left equal to its rounded main
param. Each case is compared bit for bit with the same wrapper whose main params were set by hand to what
the rule says (``expected_mains``), and the unpatched behaviour (the write undone) is shown to fail it.
Two-rank ``fully_shard`` and compiled cases: tests/multirank/main_params_writes_cases.py.
"""
import copy

import pytest
import torch
from torch import nn

from npu_fsdp_patches.optim import MainParamsOptimizer, _model_writes
from tests.fault_injection import Entry, check_entry
from tests.main_params_model import Net, backward
from tests.support import bit_mismatches

LR = 1e-2
CLIP = torch.tensor(0.05).to(torch.bfloat16).item()   # the clamp bound as a bf16 model param holds it


def _trained(dtype=torch.bfloat16, steps=3, seed=0):
    torch.manual_seed(seed)
    model = Net().to(dtype)
    opt = MainParamsOptimizer(torch.optim.AdamW(model.parameters(), lr=LR), model)
    for s in range(steps):
        backward(model, seed + s)
        opt.step()
        opt.zero_grad()
    return model, opt


def _mains(opt):
    return [opt.main_param(p).detach().clone() for g in opt.param_groups for p in g["params"]]


def expected_mains(opt):
    """The rule, written out: where the model param differs (bits) from its main param rounded, the model's
    value; elsewhere the main param, tail included."""
    out = []
    for g in opt.param_groups:
        for p in g["params"]:
            main = opt.main_param(p).detach()
            same = main.to(p.dtype).view(torch.int16) == p.detach().view(torch.int16)
            out.append(torch.where(same, main, p.detach().float()))
    return out


def _step(model, opt, seed=10):
    backward(model, seed)
    opt.step()
    opt.zero_grad()


def _assert_same(got, want):
    for i, (a, b) in enumerate(zip(got, want)):
        n, first = bit_mismatches(a, b)
        assert n == 0, f"tensor {i}: {n} elements differ, {first}"


def _against_the_rule(model, opt, write):
    """Write, then step; returns (the wrapper's tensors, the tensors of a twin whose main params were set
    to ``expected_mains`` by hand before the same step)."""
    twin_model, twin = copy.deepcopy((model, opt))
    write(model)
    write(twin_model)
    for p, value in zip([p for g in twin.param_groups for p in g["params"]], expected_mains(twin)):
        if p.dtype != torch.float32:
            twin.state[p]["main_param"] = value
    _step(model, opt)
    _step(twin_model, twin)
    return ([*model.parameters(), *_mains(opt)], [*twin_model.parameters(), *_mains(twin)])


def _rewind(snapshot):
    return lambda model: model.load_state_dict(snapshot)


def _clamp(model):
    with torch.no_grad():
        for p in model.parameters():
            p.clamp_(-0.05, 0.05)


def _reassign(model):
    model.body.weight.data = torch.full_like(model.body.weight, 0.25)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("write", ["rewind", "clamp", "reassign data"])
def test_a_write_between_steps_is_the_truth_at_the_next_step(dtype, write):
    model, opt = _trained(dtype)
    snapshot = copy.deepcopy(model.state_dict())
    for s in range(3):
        _step(model, opt, 20 + s)
    do = {"rewind": _rewind(snapshot), "clamp": _clamp, "reassign data": _reassign}[write]
    got, want = _against_the_rule(model, opt, do)
    _assert_same(got, want)


def test_the_issue_figures_rewind_and_clip_hold_after_one_step():
    """The issue's numbers: one step at lr 1e-2 moves a weight by at most about lr (AdamW's step bound)."""
    model, opt = _trained()
    snapshot = copy.deepcopy(model.state_dict())
    for s in range(20):
        _step(model, opt, 20 + s)
    model.load_state_dict(snapshot)
    _step(model, opt)
    assert max((model.state_dict()[k].float() - v.float()).abs().max().item() for k, v in snapshot.items()) < 1.1 * LR
    _clamp(model)
    _step(model, opt, 11)
    assert max(p.abs().max().item() for p in model.parameters()) < 0.05 + 1.1 * LR


def test_negative_control_the_unpatched_step_undoes_the_write(monkeypatch):
    """With the adoption switched off (the old behaviour) the comparison above fails."""
    monkeypatch.setattr(MainParamsOptimizer, "_adopt_model_writes", lambda self: None)
    model, opt = _trained()
    got, want = _against_the_rule(model, opt, _clamp)
    assert sum(bit_mismatches(a, b)[0] for a, b in zip(got, want)) > 0


def test_negative_control_a_whole_param_rederivation_loses_the_reloads_tails(monkeypatch):
    """Re-deriving every element of a written param (not only those that differ) fails the reload check."""
    monkeypatch.setattr(_model_writes, "written_elements",
                        lambda main, model: torch.ones_like(model, dtype=torch.bool))
    with pytest.raises(AssertionError):
        test_a_checkpoint_reload_keeps_the_tails("optimizer first")


def test_elements_the_write_left_equal_keep_their_fp32_tails():
    model, opt = _trained()
    before = _mains(opt)
    with torch.no_grad():
        model.body.weight[0].zero_()                 # one row written
    opt.state_dict()                                  # adopts the write, as the next step would
    after = _mains(opt)
    index = [n for n, _ in model.named_parameters()].index("body.weight")
    assert torch.equal(after[index][0], torch.zeros_like(after[index][0]))
    assert torch.equal(after[index][1:], before[index][1:])          # tails of the other rows kept
    assert all(torch.equal(a, b) for i, (a, b) in enumerate(zip(after, before)) if i != index)


@pytest.mark.parametrize("order", ["model first", "optimizer first"])
def test_a_checkpoint_reload_keeps_the_tails(order):
    """Reloading the model and the wrapper from one checkpoint, in either order, resumes bit for bit."""
    model, opt = _trained()
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    reference_model, reference = copy.deepcopy((model, opt))
    for s in range(2):
        _step(model, opt, 30 + s)
    if order == "model first":
        model.load_state_dict(saved_model)
        opt.load_state_dict(saved_opt)
    else:
        opt.load_state_dict(saved_opt)
        model.load_state_dict(saved_model)
    for s in range(2):
        _step(model, opt, 40 + s)
        _step(reference_model, reference, 40 + s)
    _assert_same([*model.parameters(), *_mains(opt)], [*reference_model.parameters(), *_mains(reference)])


def test_the_later_of_a_model_write_and_a_load_wins():
    model, opt = _trained()
    loaded = copy.deepcopy(opt.state_dict())
    _step(model, opt, 5)
    _clamp(model)                                       # model written, then the optimizer loaded: the load wins
    opt.load_state_dict(loaded)
    mains = [opt.main_param(p).clone() for p in model.parameters()]
    opt.state_dict()
    assert all(torch.equal(a, opt.main_param(p)) for a, p in zip(mains, model.parameters()))
    _clamp(model)                                       # loaded, then written: the write wins where it differs
    opt.state_dict()
    assert max(opt.main_param(p).abs().max().item() for p in model.parameters()) <= CLIP


def test_a_state_dict_taken_after_a_write_holds_the_adopted_main_params():
    model, opt = _trained()
    _clamp(model)
    sd = opt.state_dict()
    assert all(v["main_param"].abs().max() <= CLIP for v in sd["state"].values())


def test_a_step_without_writes_compares_no_values(monkeypatch):
    """Cheap detection: fingerprints only; values are compared only for params whose fingerprint moved."""
    model, opt = _trained()
    compared = []
    real = _model_writes.written_elements
    monkeypatch.setattr(_model_writes, "written_elements", lambda *a: compared.append(1) or real(*a))
    for s in range(3):
        _step(model, opt, 50 + s)
    assert compared == []
    _clamp(model)
    _step(model, opt, 60)
    assert len(compared) == len(list(model.parameters()))


def test_in_place_writes_through_p_data_are_not_seen_as_documented():
    """docs/main_params.md: torch gives ``p.data`` a version counter of its own, so an in-place write through
    it is not seen by an eager step (use ``with torch.no_grad(): p.clamp_()``, as torch recommends)."""
    model, opt = _trained()
    for p in model.parameters():
        p.data.clamp_(-0.05, 0.05)
    _step(model, opt)
    assert max(p.abs().max().item() for p in model.parameters()) > 0.06


def test_a_data_of_another_shape_is_refused_before_anything_changes():
    model, opt = _trained()
    backward(model, 7)
    grads = [p.grad.clone() for p in model.parameters()]
    mains = _mains(opt)
    model.body.weight.data = torch.zeros(2, 2, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"'body.weight'.*shape \(2, 2\).*shape \(5, 4\)"):
        opt.step()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    _assert_same(_mains(opt), mains)


def test_a_data_of_a_dtype_the_comparison_does_not_know_is_refused_before_anything_changes():
    model, opt = _trained()
    backward(model, 7)
    mains = _mains(opt)
    model.body.weight.data = model.body.weight.detach().double()
    with pytest.raises(ValueError, match=r"'body.weight'.*torch.float64 tensor.*bf16, fp16 or fp32"):
        opt.step()
    _assert_same(_mains(opt), mains)


def _written_wrapper():
    model, opt = _trained()
    _clamp(model)
    return {"model": model, "wrapper": opt}


def _reshaped_wrapper():
    handed = _written_wrapper()
    backward(handed["model"], 7)
    handed["model"].body.weight.data = torch.zeros(2, 2, dtype=torch.bfloat16)
    return handed


@pytest.mark.parametrize("mode", ["after", "before"])
@pytest.mark.parametrize("entry", [Entry("state_dict adopting model writes", _written_wrapper,
                                         lambda h: h["wrapper"].state_dict()),
                                   Entry("step: a param's .data of another shape", _reshaped_wrapper,
                                         lambda h: h["wrapper"].step(), ValueError)],
                         ids=lambda e: e.name)
def test_a_failed_adoption_changes_nothing(entry, mode):
    check_entry(entry, mode)


@pytest.mark.parametrize("write_after_load", [False, True], ids=["load only", "load, then clamp"])
def test_a_compiled_step_after_a_load_keeps_the_loaded_main_params(write_after_load, monkeypatch):
    """Compiled, writes are found by value; right after ``load_state_dict`` the main params hold values the model
    does not, so that step takes the eager route: the loaded main params survive (a by-value comparison would
    replace them by the model's stale values), and a model write made after the load still wins where it
    differs. The step runs at lr 0 so that the main params after it are what the step adopted."""
    torch._dynamo.reset()
    model, opt = _trained(steps=0)
    step = torch.compile(opt.step, backend="aot_eager")
    for s in range(3):
        backward(model, s)
        step()
        opt.zero_grad()
        if s == 0:
            loaded = copy.deepcopy(opt.state_dict())
    opt.load_state_dict(loaded)
    if write_after_load:
        _clamp(model)
    want = expected_mains(opt) if write_after_load else _mains(opt)
    for group in opt.param_groups:
        group["lr"], group["weight_decay"] = 0.0, 0.0
    backward(model, 9)
    step()
    _assert_same(_mains(opt), want)
    torch._dynamo.reset()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_the_write_check_is_torchs_cast_bit_for_bit(dtype, compiled):
    """``written_elements`` rounds with int32 ops (inductor keeps ``.to(bf16)`` in fp32 inside a kernel): over
    random fp32 bit patterns, wide magnitudes and the edges (zeros of both signs, ties, subnormals, the
    overflow to inf), it flags nothing against torch's own cast and flags every one-bit change of it."""
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (200_000,), generator=g, dtype=torch.int64).to(torch.int32)
    edges = [0.0, -0.0, 65504.0, 65519.99, 65520.0, -65520.0, 2.0 ** -14, 2.0 ** -14 - 2.0 ** -25, 2.0 ** -24,
             2.0 ** -25, 1.5 * 2.0 ** -25, 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, 1.0 + 2.0 ** -11, 1.0 - 2.0 ** -9,
             3.4e38, 1e-40, 2.0 ** -133, float("inf"), -float("inf")]
    x = torch.cat([bits.view(torch.float32), torch.randn(200_000, generator=g) * torch.logspace(-45, 38, 200_000),
                   torch.tensor(edges)])
    x = x[~torch.isnan(x)]
    model = x.to(dtype)
    neighbour = (model.view(torch.int16) ^ 1).view(dtype)
    check = torch.compile(_model_writes.written_elements, backend="inductor") if compiled \
        else _model_writes.written_elements
    assert int(check(x, model).sum()) == 0
    real = ~torch.isnan(neighbour.float())
    assert bool(check(x, neighbour)[real].all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_write_before_add_param_group_is_still_adopted(dtype):
    """``add_param_group`` re-indexes the wrapper: the params it had keep their pending writes, and a new
    fp16 param's grads are widened like the others'."""
    torch.manual_seed(0)
    model = Net().to(dtype)
    head = model.lm_head.weight
    opt = MainParamsOptimizer(torch.optim.AdamW([p for p in model.parameters() if p is not head], lr=LR), model)
    for s in range(2):
        backward(model, s)
        opt.step()
        opt.zero_grad()
    _clamp(model)
    want = expected_mains(opt)
    opt.add_param_group({"params": [head]})
    opt.state_dict()   # adopts pending writes
    _assert_same(_mains(opt)[:len(want)], want)
    assert (id(head) in opt._widened) == (id(model.body.weight) in opt._widened)
    _step(model, opt)
    assert opt.main_param(head).dtype == torch.float32 and torch.equal(opt.main_param(head).to(dtype), head)
