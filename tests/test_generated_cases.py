"""Generated cases: FusedAdam, foreach_adamw_step and MainParamsOptimizer against torch's own optimizers.

Issue 29. Hypothesis draws hyperparameters (lr float or tensor, betas, eps, weight decay, amsgrad,
maximize), dtypes (complex and float64 included), shapes (0-dim, empty, non-contiguous, uneven shards),
placements (Shard(0), Shard(1), Replicate), param-group layouts (``add_param_group``, frozen params) and
grads (None, NaN/Inf, another dtype). Each case must give its documented result
(tests/multirank/generated_cases.py ``expected``): bit-exact with torch's optimizer, or a refusal whose
message names the reason; never a wrong number. In this process the cases run on plain tensors; one
batch of cases drawn here runs on 2 gloo ranks with torch DTensors, in one launch with a hard timeout.

Profiles (``HYPOTHESIS_PROFILE``): ``default`` (derandomized, fixed example counts, the whole file well
under a minute and a half on a 2-core machine) and ``long`` (random, 10x the examples; run by hand).
Every failure found becomes an ``@example`` below (or a ``MULTIRANK_EXAMPLES`` entry).
"""
from __future__ import annotations

import json
import os

import torch
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from tests.distributed import run_ranks
from tests.multirank import generated_cases as gc

_COMMON = dict(deadline=None, database=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("npu-default", derandomize=True, **_COMMON)
settings.register_profile("npu-long", derandomize=False, **_COMMON)
_PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "default")
if _PROFILE not in ("default", "long"):
    raise ValueError(f"HYPOTHESIS_PROFILE={_PROFILE!r}: this file knows 'default' and 'long'")
_SCALE = 10 if _PROFILE == "long" else 1
_BASE = settings.get_profile("npu-long" if _PROFILE == "long" else "npu-default")


def profile(examples: int) -> settings:
    """The file's settings with ``examples`` draws (times 10 under the long profile)."""
    return settings(_BASE, max_examples=examples * _SCALE)


#: a grad of another dtype through ``.grad`` needs ``Tensor.grad_dtype`` (torch 2.13 has it); without it
#: FusedAdam gets it as ``decoupled_grad`` and MainParamsOptimizer as ``main_grad``
GRAD_DTYPE_ATTR = hasattr(torch.Tensor, "grad_dtype")

# ----------------------------------------------------------------------------- strategies

SHAPES_ONE_PROCESS = [[], [0], [1], [3], [7], [2, 3], [3, 2], [0, 3], [4, 1]]
#: on 2 ranks: 1 row leaves rank 1 empty, 3/5/7 are uneven; Shard(1) needs 2 dims
SHAPES_TWO_RANKS = [[], [0], [1], [3], [4], [7], [2, 3], [3, 1], [1, 5], [5, 3]]


def _hyper() -> st.SearchStrategy:
    return st.fixed_dictionaries({
        "lr": st.one_of(st.sampled_from([1e-3, 1e-2, 0.1]), st.floats(1e-5, 0.5)),
        "lr_tensor": st.booleans(),
        "betas": st.tuples(st.one_of(st.just(0.9), st.floats(0.0, 0.99)),
                           st.one_of(st.just(0.999), st.floats(0.5, 0.9999))),
        "eps": st.one_of(st.just(1e-8), st.floats(1e-12, 1e-2)),
        "weight_decay": st.one_of(st.just(0.0), st.just(0.01), st.floats(0.0, 0.5)),
    })


@st.composite
def _param(draw, index: int, n_groups: int, dtypes: list, two_ranks: bool, grad_kinds: list) -> dict:
    shape = draw(st.sampled_from(SHAPES_TWO_RANKS if two_ranks else SHAPES_ONE_PROCESS))
    dtype = draw(st.sampled_from(dtypes))
    layouts = ["contiguous"]
    if not two_ranks and len(shape) == 2:
        layouts.append("transposed")
    if not two_ranks and len(shape) >= 1:
        layouts.append("strided")
    placements = ["R"] + (["S0"] if len(shape) >= 1 else []) + (["S1"] if len(shape) >= 2 else [])
    spec = {
        "name": f"p{index}", "shape": shape, "dtype": dtype,
        "layout": draw(st.sampled_from(layouts)),
        "placement": draw(st.sampled_from(placements)) if two_ranks else None,
        "group": draw(st.integers(0, n_groups - 1)),
        "grad": draw(st.sampled_from(grad_kinds)),
        "grad_scale": draw(st.sampled_from([0, 0, -6, 3])),
        "frozen": draw(st.booleans()) and draw(st.booleans()),
    }
    spec["grad_layout"] = draw(st.sampled_from(layouts))
    if spec["grad"] == "other_dtype":
        spec["grad_dtype"] = draw(st.sampled_from([d for d in ("float32", "bfloat16", "float16") if d != dtype]))
    return spec


def _rarely(draw) -> bool:
    """True about one time in eight. (``sampled_from([False] * 9 + [True])`` is almost never True
    under the derandomized profile: Hypothesis favours a list's first elements.)"""
    return draw(st.booleans()) and draw(st.booleans()) and draw(st.booleans())


@st.composite
def cases(draw, optimizer: str, *, two_ranks: bool = False, dtypes: list | None = None) -> dict:
    """One case for ``optimizer`` ("fused_adam", "foreach", "main_params")."""
    n_groups = draw(st.integers(1, 2))
    if optimizer == "fused_adam":
        dtypes = dtypes or ["float32", "float32", "bfloat16", "float16"]
        options = {"adam_w_mode": draw(st.booleans()), "master_weights": draw(st.booleans()),
                   "decoupled_grad": draw(st.booleans()),
                   # the constructor's refusals (docs/te_fused_adam.md#12-constructor-errors)
                   "amsgrad": _rarely(draw), "maximize": _rarely(draw),
                   "exp_avg_dtype": draw(st.sampled_from(["float32", "bfloat16"])),
                   "exp_avg_sq_dtype": draw(st.sampled_from(["float32", "bfloat16"]))}
        grad_kinds = ["normal", "normal", "none", "nan", "inf", "other_dtype"]
    elif optimizer == "foreach":
        dtypes = dtypes or ["float32", "bfloat16", "float16", "float64", "complex64"]
        fused = draw(st.sampled_from([False, False, True]))
        options = {"cls": draw(st.sampled_from(["AdamW", "Adam"])),
                   "foreach": None if fused else draw(st.sampled_from([None, True, False])),
                   "fused": fused, "amsgrad": draw(st.booleans()), "maximize": draw(st.booleans()),
                   "capturable": _rarely(draw), "differentiable": _rarely(draw)}
        grad_kinds = ["normal", "normal", "none", "nan", "inf"] + (["other_dtype"] if GRAD_DTYPE_ATTR else [])
    elif optimizer == "main_params":
        dtypes = dtypes or ["bfloat16", "bfloat16", "float16", "float32"] + ["float64", "complex64"] * (
            not two_ranks and _rarely(draw))
        fused = draw(st.sampled_from([False, False, True]))
        options = {"cls": draw(st.sampled_from(["AdamW", "Adam"])),
                   "foreach": None if fused else draw(st.sampled_from([None, True, False])),
                   "fused": fused, "amsgrad": draw(st.booleans()), "maximize": draw(st.booleans()),
                   "add_group_after_wrap": _rarely(draw)}
        grad_kinds = ["normal", "normal", "none", "nan", "inf", "other_dtype"]
    else:
        raise ValueError(optimizer)
    n_params = draw(st.integers(1, 4))
    params = [draw(_param(i, n_groups, dtypes, two_ranks, grad_kinds)) for i in range(n_params)]
    for spec in params:
        if optimizer == "fused_adam" and spec["grad"] == "other_dtype" and not GRAD_DTYPE_ATTR:
            options["decoupled_grad"] = True
        if optimizer == "main_params":
            spec["frozen_in_optimizer"] = spec["frozen"] and draw(st.booleans())
            if spec["grad"] != "other_dtype":   # a main_grad may have any layout: the wrapper lays out
                spec["grad_layout"] = spec["layout"]   # its fp32 copy; a .grad reaches the leaf as is
            if options["fused"] and spec["dtype"] == "float32" and spec["layout"] == "strided":
                # an fp32 param is its own main param, handed to the leaf as is, and torch's fused
                # AdamW mis-steps a non-dense param by itself (docs/main_params.md#6-limits)
                spec["layout"] = "contiguous"
                if spec["grad"] != "other_dtype":
                    spec["grad_layout"] = "contiguous"
    return {"optimizer": optimizer, "seed": draw(st.integers(0, 2 ** 16)), "steps": draw(st.integers(1, 3)),
            "add_param_group": draw(st.booleans()), "groups": [draw(_hyper()) for _ in range(n_groups)],
            "options": options, "params": params}


def _p(shape, dtype="float32", **kw) -> dict:
    """A param spec for the explicit examples."""
    spec = {"name": kw.pop("name", "p0"), "shape": shape, "dtype": dtype, "layout": "contiguous",
            "placement": None, "group": 0, "grad": "normal", "grad_scale": 0, "frozen": False,
            "frozen_in_optimizer": False}
    spec.update(kw)
    spec.setdefault("grad_layout", spec["layout"])
    return spec


def _case(optimizer: str, params: list, options: dict, *, groups: list | None = None, steps: int = 2,
          seed: int = 0, add_param_group: bool = False) -> dict:
    hyper = {"lr": 1e-2, "lr_tensor": False, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
    return {"optimizer": optimizer, "seed": seed, "steps": steps, "add_param_group": add_param_group,
            "groups": groups or [hyper], "options": options, "params": params}


FUSED = {"adam_w_mode": True, "master_weights": False, "decoupled_grad": False, "amsgrad": False,
         "maximize": False}
FOREACH = {"cls": "AdamW", "foreach": None, "fused": False, "amsgrad": False, "maximize": False,
           "capturable": False, "differentiable": False}
MAIN = {"cls": "AdamW", "foreach": None, "fused": False, "amsgrad": False, "maximize": False,
        "add_group_after_wrap": False}


def _assert_documented(case: dict) -> None:
    problem = gc.check_case(case)
    assert problem is None, f"{problem}\ncase: {case}"


# ----------------------------------------------------------------------------- one process

@profile(100)
@given(case=cases("fused_adam"))
@example(case=_case("fused_adam", [_p([2, 3], "bfloat16", layout="transposed"), _p([], grad="nan")],
                    {**FUSED, "master_weights": True}))
@example(case=_case("fused_adam", [_p([])], {**FUSED, "amsgrad": True, "maximize": True}))
@example(case=_case("fused_adam", [_p([3], grad="other_dtype", grad_dtype="bfloat16"), _p([0, 3], "float16")],
                    {**FUSED, "adam_w_mode": False, "decoupled_grad": not GRAD_DTYPE_ATTR},
                    groups=[{"lr": 0.1, "lr_tensor": True, "betas": [0.5, 0.9], "eps": 1e-3,
                             "weight_decay": 0.3}]))
def test_fused_adam_matches_torch_fused_adamw(case):
    """bf16/fp16/fp32 params: bit-exact with torch's fused AdamW on the fp32 workspace; amsgrad and
    maximize refused by the constructor."""
    _assert_documented(case)


def _with_grads(case: dict) -> dict:
    """Every param trainable and given a grad (TE refuses a dtype at the step of a param with a grad)."""
    for spec in case["params"]:
        spec.update(frozen=False, grad="normal" if spec["grad"] in ("none", "other_dtype") else spec["grad"])
    return case


@profile(15)
@given(case=cases("fused_adam", dtypes=["float64", "complex64"]).map(_with_grads))
@example(case=_case("fused_adam", [_p([2], "complex64")], FUSED))
@example(case=_case("fused_adam", [_p([3], "float64"), _p([3], "float32")], FUSED))
def test_fused_adam_refuses_float64_and_complex_params(case):
    """KNOWN BUG (issue 29), expected to FAIL until the refusal fix merges: on plain tensors FusedAdam
    computes float64 params in float32 and drops the imaginary part of complex ones, where TE and our
    DTensor path refuse them. The documented result is a refusal naming the dtype. Do not weaken this
    expectation or mark it xfail: it turns green with the fix."""
    _assert_documented(case)


@profile(150)
@given(case=cases("foreach"))
@example(case=_case("foreach", [_p([3], "complex64"), _p([2, 3], "bfloat16", layout="transposed",
                                                       grad_layout="contiguous")],
                    {**FOREACH, "amsgrad": True, "maximize": True},
                    groups=[{"lr": 1e-2, "lr_tensor": True, "betas": [0.9, 0.999], "eps": 1e-8,
                             "weight_decay": 0.1}]))
@example(case=_case("foreach", [_p([3, 2], layout="transposed", grad_layout="contiguous"), _p([0])],
                    {**FOREACH, "fused": True}))
@example(case=_case("foreach", [_p([3], "complex64")], {**FOREACH, "fused": True}))
@example(case=_case("foreach", [_p([2])], {**FOREACH, "capturable": True}))
@example(case=_case("foreach", [_p([1])], {**FOREACH, "fused": True, "capturable": True, "differentiable": True}))
# found by the long profile, harness bugs: a "transposed" [4, 1] param shared its storage with the
# reference's (``contiguous()`` of a [1, 4] view is the view itself); a tensor lr's reference was the
# float drawn, not the fp32 tensor's value
@example(case=_case("foreach", [_p([4, 1], layout="transposed")], {**FOREACH, "cls": "Adam"}))
@example(case=_case("foreach", [_p([], "float64")], FOREACH,
                    groups=[{"lr": 1e-3, "lr_tensor": True, "betas": [0.9, 0.999], "eps": 1e-8,
                             "weight_decay": 0.0}]))
def test_foreach_adamw_step_matches_torch_foreach_adam(case):
    """Bit-exact with torch's Adam/AdamW(foreach=True) (fused=True where the group sets it), or the
    same refusal torch gives; capturable and differentiable refused naming the option."""
    _assert_documented(case)


@profile(150)
@given(case=cases("main_params"))
@example(case=_case("main_params", [_p([2, 3], "bfloat16", layout="transposed"),
                                    _p([3], "float16", name="p1", grad="other_dtype", grad_dtype="float32"),
                                    _p([4], name="p2", frozen=True)],
                    {**MAIN, "fused": True},
                    groups=[{"lr": 1e-2, "lr_tensor": False, "betas": [0.9, 0.999], "eps": 1e-8,
                             "weight_decay": 0.01},
                            {"lr": 0.1, "lr_tensor": True, "betas": [0.8, 0.9], "eps": 1e-6,
                             "weight_decay": 0.0}], add_param_group=True))
@example(case=_case("main_params", [_p([3], "bfloat16"), _p([2], "float64", name="p1")], MAIN))
@example(case=_case("main_params", [_p([], "float64", group=1), _p([], "complex64", name="p1")], MAIN,
                    groups=[{"lr": 1e-3, "lr_tensor": False, "betas": [0.9, 0.999], "eps": 1e-8,
                             "weight_decay": 0.0}] * 2))
# a frozen float64 param the optimizer is not given is the model's own business (long profile)
@example(case=_case("main_params", [_p([3], "bfloat16"), _p([], "float64", name="p1", frozen=True)], MAIN))
# found by this file: a non-contiguous fp32 main_grad reached a fused leaf as is (fp32_grad's
# ``.to(memory_format=contiguous)`` returns an fp32 tensor unchanged), and torch's fused kernel paired
# its elements with the contiguous main param by memory position: wrong numbers, no error
@example(case=_case("main_params", [_p([3], "bfloat16", layout="strided", grad="other_dtype",
                                       grad_dtype="float32"),
                                    _p([2, 3], name="p1", layout="transposed", grad="other_dtype",
                                       grad_dtype="float32"),
                                    _p([3, 2], name="p2", layout="transposed", grad="other_dtype",
                                       grad_dtype="float32", grad_layout="contiguous")],
                    {**MAIN, "fused": True}, steps=1))
@example(case=_case("main_params", [_p([3], "bfloat16")], {**MAIN, "add_group_after_wrap": True}))
def test_main_params_matches_an_fp32_master_reference(case):
    """Main params bit-equal to the same leaf optimizer on fp32 copies, model params equal to them
    rounded; float64/complex params (their own main params) and add_param_group on the wrapper as on the
    leaf optimizer (issue 42)."""
    _assert_documented(case)


# ----------------------------------------------------------------------------- the checks can fail

def _nudge(tensors) -> None:
    """Move every element one ulp up (the negative controls' planted 1-ulp error)."""
    with torch.no_grad():
        for t in tensors:
            local = t.to_local() if hasattr(t, "to_local") else t
            local.copy_(torch.nextafter(local, torch.full_like(local, float("inf"))))


def test_negative_control_one_ulp_in_each_optimizer_is_caught(monkeypatch):
    from npu_fsdp_patches.optim import foreach_adamw as foreach_module
    from npu_fsdp_patches.optim import fused_adam_step
    from npu_fsdp_patches.optim.main_params import MainParamsOptimizer

    fused_case = _case("fused_adam", [_p([5])], FUSED)
    foreach_case = _case("foreach", [_p([5], "bfloat16")], FOREACH)
    main_case = _case("main_params", [_p([5], "bfloat16")], MAIN)
    for case in (fused_case, foreach_case, main_case):
        assert gc.check_case(case) is None, case

    kernel = fused_adam_step.adamw_kernel
    monkeypatch.setattr(fused_adam_step, "adamw_kernel", lambda ws, *a, **k: (kernel(ws, *a, **k), _nudge(ws)))
    locals_step = foreach_module._adam_on_locals
    monkeypatch.setattr(foreach_module, "_adam_on_locals",
                        lambda fn, params, *a, **k: (locals_step(fn, params, *a, **k), _nudge(params)))
    copy = MainParamsOptimizer._copy_main_params_to_model_params
    monkeypatch.setattr(MainParamsOptimizer, "_copy_main_params_to_model_params",
                        lambda self: (_nudge(list(self._main_params())), copy(self)))
    for case in (fused_case, foreach_case, main_case):
        problem = gc.check_case(case)
        assert problem is not None and problem.startswith("wrong result") and "differ" in problem, (case, problem)


def test_negative_control_a_computed_refusal_and_a_wrong_reason_are_caught(monkeypatch):
    case = _case("fused_adam", [_p([3])], FUSED)
    monkeypatch.setattr(gc, "expected", lambda c: ("refuse", "some reason"))
    assert gc.check_case(case).startswith("computed where a refusal is documented")
    refused = _case("fused_adam", [_p([3])], {**FUSED, "amsgrad": True})
    assert "expected the reason" in gc.check_case(refused)


# ----------------------------------------------------------------------------- 2 gloo ranks

#: explicit two-rank cases: empty and uneven shards, Shard(1), tensor lr, refusals on DTensor
MULTIRANK_EXAMPLES = [
    _case("fused_adam", [_p([1], placement="S0"), _p([5, 3], "bfloat16", placement="S1", name="p1"),
                         _p([], placement="R", name="p2", grad="inf")], {**FUSED, "master_weights": True},
          groups=[{"lr": 0.05, "lr_tensor": True, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.1}]),
    _case("fused_adam", [_p([3], "complex64", placement="S0")], FUSED),
    _case("fused_adam", [_p([3], "float64", placement="R")], FUSED),
    _case("foreach", [_p([3], "complex64", placement="S0"), _p([1, 5], "bfloat16", placement="S1", name="p1")],
          {**FOREACH, "amsgrad": True}),
    _case("foreach", [_p([7], "float16", placement="S0", grad="nan")], {**FOREACH, "fused": True}),
    # found by the batch (reference design): torch's fused kernel rounds exp_avg_sq of a Shard(1) local
    # differently from the full tensor's, so the reference runs on the local shards; torch's own
    # AdamW(foreach=True) fails on a 0-dim complex Replicate DTensor and mis-steps a Shard(0) one
    _case("fused_adam", [_p([5, 3], placement="S1", grad_scale=3)], {**FUSED, "adam_w_mode": False}),
    _case("foreach", [_p([], "complex64", placement="R"), _p([3], "complex64", placement="S0", name="p1")],
          FOREACH),
    _case("main_params", [_p([3, 1], "bfloat16", placement="S0"), _p([1], name="p1", placement="S0"),
                          _p([2, 3], "float16", name="p2", placement="S1", grad="other_dtype",
                             grad_dtype="float32")], {**MAIN, "foreach": True}),
]


def _draw(strategy: st.SearchStrategy, count: int) -> list:
    """``count`` cases drawn by Hypothesis here (derandomized under the default profile), to run
    elsewhere: no shrinking, each failure is reported with its case."""
    drawn = []

    @settings(_BASE, max_examples=count * _SCALE, phases=[Phase.generate])
    @given(strategy)
    def collect(case):
        if case not in drawn:
            drawn.append(case)
    collect()
    return drawn


def test_generated_cases_on_two_ranks_with_dtensors(tmp_path):
    batch = list(MULTIRANK_EXAMPLES)
    for optimizer, count in (("fused_adam", 50), ("foreach", 50), ("main_params", 50)):
        batch += _draw(cases(optimizer, two_ranks=True), count)
    cases_file = tmp_path / "cases.json"
    cases_file.write_text(json.dumps(batch))
    results = run_ranks("tests.multirank.generated_cases:case_batch", 2, args={"cases_file": str(cases_file)},
                        timeout=240 * _SCALE)
    failures = [f"rank {rank}: {problem}\ncase: {case}"
                for rank, problems in enumerate(results)
                for case, problem in zip(batch, problems) if problem is not None]
    assert not failures, f"{len(failures)} of {2 * len(batch)} rank-cases failed:\n" + "\n".join(failures[:10])
