"""Generated cases: FusedAdam, foreach_adamw_step and MainParamsOptimizer against torch's own optimizers.

Issue 29. Hypothesis draws hyperparameters (lr float or tensor, betas, eps, weight decay, amsgrad,
maximize), dtypes (complex and float64 included), shapes (0-dim, empty, non-contiguous, uneven shards),
placements (Shard(0), Shard(1), Replicate on one mesh dim; pairs of them and FSDP2's strided shard on
two), param-group layouts (``add_param_group``, frozen params), grads (None, NaN/Inf, another dtype, a
first grad only late in the run) and, issue 40, a resume midway: FusedAdam from its own state dict or a
one-process run's full state, MainParamsOptimizer over one or two leaf optimizers (Adam/AdamW, SGD,
Muon; a list, a dict or a chained optimizer) through its state dict, torch's state-dict API or a DCP
checkpoint. Each case must give its documented result
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
from tests.torch_versions import (FLAT_LOAD_FILLS_MISSING_KEYS, STRIDED_SHARD_SPLITS_UNEVENLY,
                                  loads_params_without_state)

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


#: torch's set_optimizer_state_dict loads a state dict without an entry for some param (torch 2.6.0 raises
#: KeyError, for any optimizer): else a case through torch's API whose saved state would lack one (an fp32
#: param without leaf state; a bf16/fp16 one has its main param) resumes through the state dict instead
TORCH_API_LOADS_STATELESS = loads_params_without_state()
TORCH_CHECKPOINTS = ("torch_api", "torch_api_flat", "dcp")

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


def _placements(shape: list, mesh: list) -> list[str]:
    """Every placement a param of ``shape`` can have on ``mesh`` (one per mesh dim, comma-separated:
    gc.placement): Replicate, Shard of each dim, and on the [1, 2] mesh FSDP2's strided shard of a
    dim that TP shards too (the 1-D ``_StridedShard`` of DTensor views is not a param's placement)."""
    one = [f"S{d}" for d in range(min(len(shape), 2))][::-1] + ["R"]   # sharded first: drawn more often
    if len(mesh) == 1:
        return one
    strided = ([f"SS{d},S{d}" for d in range(min(len(shape), 2)) if _strided_builds(shape, d)]
               if mesh == [1, 2] else [])
    return strided + [f"{a},{b}" for a in one for b in one]


def _strided_builds(shape: list, dim: int) -> bool:
    """Whether this torch can build FSDP2's strided shard of ``dim`` over the 2 ranks (torch 2.7 only
    splits it evenly: tests/torch_versions.py)."""
    return STRIDED_SHARD_SPLITS_UNEVENLY or shape[dim] % 2 == 0


def _buildable(case: dict) -> bool:
    """A listed case every param of which this torch can build as a DTensor."""
    return all(_strided_builds(p["shape"], int(p["placement"][2]))
               for p in case["params"] if (p.get("placement") or "").startswith("SS"))


@st.composite
def _param(draw, index: int, n_groups: int, dtypes: list, two_ranks: bool, grad_kinds: list,
           mesh: list | None = None) -> dict:
    shape = draw(st.sampled_from(SHAPES_TWO_RANKS if two_ranks else SHAPES_ONE_PROCESS))
    dtype = draw(st.sampled_from(dtypes))
    layouts = ["contiguous"]
    if not two_ranks and len(shape) == 2:
        layouts.append("transposed")
    if not two_ranks and len(shape) >= 1:
        layouts.append("strided")
    mesh = mesh or (draw(st.sampled_from(gc.MESH_SHAPES)) if two_ranks else None)
    spec = {
        "name": f"p{index}", "shape": shape, "dtype": dtype,
        "layout": draw(st.sampled_from(layouts)),
        "placement": draw(st.sampled_from(_placements(shape, mesh))) if two_ranks else None,
        "group": draw(st.integers(0, n_groups - 1)),
        "grad": draw(st.sampled_from(grad_kinds)),
        "grad_scale": draw(st.sampled_from([0, 0, -6, 3])),
        "frozen": draw(st.booleans()) and draw(st.booleans()),
    }
    if two_ranks and mesh != [2]:
        spec["mesh"] = mesh
    spec["grad_layout"] = draw(st.sampled_from(layouts))
    if spec["grad"] == "other_dtype":
        spec["grad_dtype"] = draw(st.sampled_from([d for d in ("float32", "bfloat16", "float16") if d != dtype]))
    return spec


def _rarely(draw) -> bool:
    """True about one time in eight. (``sampled_from([False] * 9 + [True])`` is almost never True
    under the derandomized profile: Hypothesis favours a list's first elements.)"""
    return draw(st.booleans()) and draw(st.booleans()) and draw(st.booleans())


#: Muon steps 2-D params only (torch.optim.Muon refuses others when built)
MUON_SHAPES = [[2, 3], [3, 2], [4, 1]]


@st.composite
def cases(draw, optimizer: str, *, two_ranks: bool = False, dtypes: list | None = None) -> dict:
    """One case for ``optimizer`` ("fused_adam", "foreach", "main_params")."""
    n_groups = draw(st.integers(1, 2))
    extra = {}
    if optimizer == "fused_adam":
        dtypes = dtypes or ["float32", "float32", "bfloat16", "float16"]
        options = {"adam_w_mode": draw(st.booleans()), "master_weights": draw(st.booleans()),
                   "decoupled_grad": draw(st.booleans()),
                   # the constructor's refusals (docs/te_fused_adam.md#12-constructor-errors)
                   "amsgrad": _rarely(draw), "maximize": _rarely(draw),
                   "exp_avg_dtype": draw(st.sampled_from(["float32", "bfloat16"])),
                   "exp_avg_sq_dtype": draw(st.sampled_from(["float32", "bfloat16"]))}
        grad_kinds = ["normal", "normal", "none", "nan", "inf", "other_dtype"]
        # resumed midway from its own state dict, or (on the ranks) from a one-process run's full state
        extra["checkpoint"] = draw(st.sampled_from(["full", "own", "full", "none"] if two_ranks else ["own", "none"]))
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
        # a second leaf optimizer (SGD0: without momentum, so without state; Muon steps whole
        # matrices: not on sharded params); group gi belongs to leaf gi % 2, handed over as a list, a
        # dict or a chained optimizer
        second = draw(st.sampled_from([None, "SGD", "SGD0", "AdamW"] + ([] if two_ranks else ["Muon"])))
        options = {"cls": draw(st.sampled_from(["AdamW", "Adam"])),
                   "foreach": None if fused else draw(st.sampled_from([None, True, False])),
                   "fused": fused, "amsgrad": draw(st.booleans()), "maximize": draw(st.booleans()),
                   "add_group_after_wrap": _rarely(draw)}
        if second:
            n_groups = draw(st.integers(2, 3))
            options.update(second=second, container=draw(st.sampled_from(["list", "dict", "chain"])))
        # "late": no grad (so no state) until the resume step, then grads
        grad_kinds = ["normal", "normal", "none", "late", "nan", "inf", "other_dtype"]
        # a DCP checkpoint costs about 0.3 s a case (files written and read): drawn about once in eight
        extra["checkpoint"] = "dcp" if _rarely(draw) else draw(st.sampled_from(
            ["torch_api", "state_dict", "none"] + (["torch_api_flat"] if FLAT_LOAD_FILLS_MISSING_KEYS else [])))
    else:
        raise ValueError(optimizer)
    torch_checkpoint = extra.get("checkpoint") in TORCH_CHECKPOINTS
    n_params = draw(st.integers(n_groups if torch_checkpoint else 1, 5 if optimizer == "main_params" else 4))
    # MainParamsOptimizer's leaves are torch's optimizers, which step the DTensors of a group together:
    # one mesh for all (torch 2.6 refuses DTensors of several meshes in one foreach or fused call)
    mesh = draw(st.sampled_from(gc.MESH_SHAPES)) if two_ranks and optimizer == "main_params" else None
    params = [draw(_param(i, n_groups, dtypes, two_ranks, grad_kinds, mesh)) for i in range(n_params)]
    if torch_checkpoint:   # a param in each group (see below)
        for gi, spec in enumerate(params[:n_groups]):
            spec["group"] = gi
    for spec in params:
        if optimizer == "fused_adam" and spec["grad"] == "other_dtype" and not GRAD_DTYPE_ATTR:
            options["decoupled_grad"] = True
        if optimizer == "main_params":
            if options.get("second") == "Muon" and spec["group"] % 2 == 1 and spec["shape"] not in MUON_SHAPES:
                spec["shape"] = draw(st.sampled_from(MUON_SHAPES))
            spec["frozen_in_optimizer"] = spec["frozen"] and draw(st.booleans())
            if spec["grad"] != "other_dtype":   # a main_grad may have any layout: the wrapper lays out
                spec["grad_layout"] = spec["layout"]   # its fp32 copy; a .grad reaches the leaf as is
            if options["fused"] and spec["dtype"] == "float32" and spec["layout"] == "strided":
                # an fp32 param is its own main param, handed to the leaf as is, and torch's fused
                # AdamW mis-steps a non-dense param by itself (docs/main_params.md#6-limits)
                spec["layout"] = "contiguous"
                if spec["grad"] != "other_dtype":
                    spec["grad_layout"] = "contiguous"
    if torch_checkpoint and not _groups_filled(params, n_groups):
        # torch's set_optimizer_state_dict leaves a param group without params (followed by one with
        # params) without any setting, lr and betas included, for any optimizer: it maps the last
        # saved group to it, and then to its own group (_split_optim_state_dict's ``loaded_param_group``
        # after its loop, torch/distributed/checkpoint/state_dict.py, torch 2.13). Such cases resume
        # through state_dict
        extra["checkpoint"] = "state_dict"
    steps = draw(st.integers(1, 3))
    case = {"optimizer": optimizer, "seed": draw(st.integers(0, 2 ** 16)), "steps": steps,
            "add_param_group": draw(st.booleans()), "groups": [draw(_hyper()) for _ in range(n_groups)],
            "options": options, "params": params}
    if extra.get("checkpoint", "none") != "none":
        case["steps"] = max(steps, 2)
        extra["resume_at"] = draw(st.integers(1, case["steps"] - 1))
    return _through_what_torch_loads({**case, **extra})


def _through_what_torch_loads(case: dict) -> dict:
    """``case``, resumed through the wrapper's own state dict instead of torch's API where this torch
    cannot load a saved state without some param's entry (TORCH_API_LOADS_STATELESS), and unflattened
    where a group has no params (torch's flattened load names a group by its first param: IndexError in
    ``_unflatten_optim_state_dict``, torch 2.13, for any optimizer)."""
    if (case.get("checkpoint") in TORCH_CHECKPOINTS and not TORCH_API_LOADS_STATELESS
            and not all(gc.saved_with_state(case, p) for p in case["params"] if gc.in_optimizer(p))):
        return {**case, "checkpoint": "state_dict"}
    if case.get("checkpoint") == "torch_api_flat" and case["options"].get("add_group_after_wrap"):
        return {**case, "checkpoint": "torch_api"}
    return case


def _groups_filled(params: list, n_groups: int) -> bool:
    """Every param group of a MainParamsOptimizer case holds a param the optimizer is given."""
    return all(any(p["group"] == gi and gc.in_optimizer(p) for p in params) for gi in range(n_groups))


def _p(shape, dtype="float32", **kw) -> dict:
    """A param spec for the explicit examples."""
    spec = {"name": kw.pop("name", "p0"), "shape": shape, "dtype": dtype, "layout": "contiguous",
            "placement": None, "group": 0, "grad": "normal", "grad_scale": 0, "frozen": False,
            "frozen_in_optimizer": False}
    spec.update(kw)
    spec.setdefault("grad_layout", spec["layout"])
    return spec


def _case(optimizer: str, params: list, options: dict, *, groups: list | None = None, steps: int = 2,
          seed: int = 0, add_param_group: bool = False, **resume) -> dict:
    """A case for the explicit examples; ``resume``: ``checkpoint`` and ``resume_at``."""
    hyper = {"lr": 1e-2, "lr_tensor": False, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
    return _through_what_torch_loads({
        "optimizer": optimizer, "seed": seed, "steps": steps, "add_param_group": add_param_group,
        "groups": groups or [hyper], "options": options, "params": params, **resume})


FUSED = {"adam_w_mode": True, "master_weights": False, "decoupled_grad": False, "amsgrad": False,
         "maximize": False}
FOREACH = {"cls": "AdamW", "foreach": None, "fused": False, "amsgrad": False, "maximize": False,
           "capturable": False, "differentiable": False}
MAIN = {"cls": "AdamW", "foreach": None, "fused": False, "amsgrad": False, "maximize": False,
        "add_group_after_wrap": False}


def _examples(*listed: dict):
    """``@example`` for each of ``listed``."""
    def decorate(test):
        for case in reversed(listed):
            test = example(case=case)(test)
        return test
    return decorate


_TWO_GROUPS = [{"lr": 1e-2, "lr_tensor": False, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
               {"lr": 0.05, "lr_tensor": False, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.1}]
#: two leaf optimizers whose first has params without state when the run is saved (no grad so far,
#: frozen, a grad only after the resume) ahead of params with state, the second leaf with state or
#: without any (SGD0: its trained bf16 params' main params are their only state): resumed through each
#: checkpoint path, each container
RESUMED_LEAVES = [
    _case("main_params", [_p([3], "bfloat16", grad="none"), _p([2], "bfloat16", name="p1", frozen=True,
                                                              frozen_in_optimizer=True),
                          _p([4], "bfloat16", name="p2", grad="late"), _p([5], "bfloat16", name="p3"),
                          _p([2, 3], "bfloat16", name="p4", group=1), _p([3, 2], name="p5", group=1)],
          {**MAIN, "second": second, "container": container}, groups=_TWO_GROUPS, steps=3,
          checkpoint=checkpoint, resume_at=1)
    for second, container, checkpoint in (
        ("SGD", "list", "state_dict"), ("AdamW", "dict", "torch_api"), ("Muon", "chain", "dcp"),
        ("SGD0", "chain", "dcp"), ("Muon", "list", "state_dict"), ("SGD0", "list", "state_dict"),
        ("SGD0", "dict", "torch_api"))
] + ([_case("main_params", [_p([3], "bfloat16", grad="none"), _p([5], "float16", name="p1"),
                            _p([2, 3], "bfloat16", name="p2", group=1)],
            {**MAIN, "second": "AdamW", "container": "list"}, groups=_TWO_GROUPS, steps=2,
            checkpoint="torch_api_flat", resume_at=1)] if FLAT_LOAD_FILLS_MISSING_KEYS else [])


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
@_examples(*RESUMED_LEAVES)
# found by the long profile (harness): torch's set_optimizer_state_dict primes the new optimizer at lr 0,
# which torch refuses for a tensor lr on the foreach path, for any optimizer: so must the wrapper
@example(case=_case("main_params", [_p([0], "bfloat16", grad="none"), _p([], "bfloat16", name="p1", group=1)],
                    {**MAIN, "foreach": True}, groups=[{**_TWO_GROUPS[0], "lr_tensor": True}, _TWO_GROUPS[1]],
                    checkpoint="torch_api", resume_at=1))
def test_main_params_matches_an_fp32_master_reference(case):
    """Main params bit-equal to the same leaf optimizer on fp32 copies, model params equal to them
    rounded, the states equal and present for the same params, also across a resume (the wrapper's
    state dict, torch's API, DCP); float64/complex params (their own main params) and add_param_group on
    the wrapper as on the leaf optimizer (issue 42), refused over several leaves."""
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
] + [
    # a one-process run's full state loaded at step 1 into every placement a param can have, uneven
    # and empty shards included: 1-D mesh, then two mesh dims of sizes 2x1 and 1x2
    _case("fused_adam", [_p(shape, dtype, name=f"p{i}", placement=pl, **({"mesh": mesh} if mesh else {}))
                         for i, (shape, pl) in enumerate(params)],
          {**FUSED, **options}, steps=3, checkpoint="full", resume_at=1)
    for mesh, params in (
        (None, [([7], "S0"), ([1], "S0"), ([5, 3], "S1"), ([2, 3], "S1"), ([3], "R"), ([], "R")]),
        ([2, 1], [([5, 3], "S0,S1"), ([5, 3], "S1,S0"), ([3], "R,S0"), ([7], "S0,S0"), ([1, 5], "S1,R")]),
        ([1, 2], [([7], "SS0,S0"), ([5, 3], "SS1,S1"), ([2, 3], "R,S1"), ([5, 3], "S0,S1"), ([1], "R,S0"),
                  ([3, 1], "S1,S0")]))
    for dtype, options in (("float32", {}),
                           ("bfloat16", {"master_weights": True, "exp_avg_dtype": "bfloat16"}))
] + [
    # two leaves, the first with params without state when saved (no grad so far, a grad only after
    # the resume) ahead of one with state, on sharded params: each checkpoint path
    _case("main_params", [_p([5, 3], "bfloat16", placement=placements[0], grad="none", **mesh),
                          _p([7], "bfloat16", name="p1", placement=placements[0], grad="late", **mesh),
                          _p([1], "bfloat16", name="p2", placement=placements[1], **mesh),
                          _p([3, 1], "bfloat16", name="p3", placement=placements[2], group=1, **mesh),
                          _p([2, 3], name="p4", placement=placements[2], group=1, **mesh)],
          {**MAIN, "second": second, "container": container}, groups=_TWO_GROUPS, steps=3,
          checkpoint=checkpoint, resume_at=1)
    for second, container, checkpoint, mesh, placements in (
        ("SGD", "list", "torch_api", {}, ("S0", "R", "S1")),
        ("AdamW", "chain", "dcp", {"mesh": [2, 1]}, ("S0,R", "R,S0", "S1,S0")),
        ("SGD0", "dict", "state_dict", {"mesh": [1, 2]}, ("SS0,S0", "R,S0", "S1,S0")))
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
    batch = [case for case in MULTIRANK_EXAMPLES if _buildable(case)]
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
