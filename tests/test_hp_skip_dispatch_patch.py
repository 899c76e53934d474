"""Patch hp_skip_dispatch_adamw against the hyper-parallel stand-ins of both generations and the veomni
fork's wrap_optimizer (docs/design.md#44-hp_skip_dispatch_adamw; issue 5 item 2). Each scenario runs in a
fresh interpreter (child code: tests/children/hp_skip_dispatch.py).

Reference everywhere: the same torch optimizer on torch DTensors (1-rank gloo mesh) with the same
flags, i.e. what torch FSDP2 computes. "accelerator" runs pretend cpu has default foreach kernels
(as cuda/npu have), so torch's own choice differs between its DTensor and hyper's.
"""
import pytest

from tests.support import install_fixture, run_case
from tests.torch_versions import ADAMW_IS_ADAM


def run_child(case, sites, env=None, **args):
    return run_case(f"tests.children.hp_skip_dispatch:{case}", args=args, paths=sites, env=env,
                    timeout=240)


@pytest.fixture(scope="module", params=["new", "old"])
def generation(request, tmp_path_factory):
    site = install_fixture(f"hyper_parallel_{request.param}", tmp_path_factory.mktemp(request.param))
    return request.param, run_child("generation_case", [site], generation=request.param)


def test_enabled_by_gate_and_applied_at_torch_import(generation):
    _, r = generation
    assert r["patched"]
    assert r["record"]["decision"] == "enabled" and r["record"]["state"] == "applied", r["record"]
    assert r["record"]["targets"] == ["torch.optim.adam:adam", "torch.optim.adamw:adamw",
                                      "torch.optim.adamw:adam?", "torch.optim._functional:adam?",
                                      "torch.optim._functional:adamw?"]
    # torch 2.6's torch.optim.adamw has its own kernels and no `adam` copy
    copies = ["torch.optim.adamw:adam"] if ADAMW_IS_ADAM else []
    assert sorted(r["record"]["applied_targets"]) == sorted(
        ["torch.optim.adam:adam", "torch.optim.adamw:adamw", "torch.optim._functional:adam",
         "torch.optim._functional:adamw"] + copies)


@pytest.mark.parametrize("device", ["accel", "cpu"])
@pytest.mark.parametrize("flags", ["default", "foreach=True", "foreach=False", "fused=True"])
def test_bit_exact_with_torch_dtensor_for_every_flag(generation, device, flags):
    _, r = generation
    case = r[f"{device}_{flags}"]
    assert case["equal"], case
    assert case["impl"] == case["ref_impl"], case      # same torch implementation as for torch DTensor
    assert case["types"] == ["Tensor"], case           # ... run on the plain local shards


def test_torch_alone_picks_single_tensor_for_hyper_type(generation):
    _, r = generation
    assert r["accel_default_choice"] == {"torch": [False, True], "hyper": [False, False]}
    assert r["cpu_default_choice"] == {"torch": [False, False], "hyper": [False, False]}
    assert r["accel_default"]["impl"] == ["_multi_tensor_adam"]
    assert not r["reverted"]["patched"]
    assert r["reverted"]["impl"] == ["_single_tensor_adam"] and r["reverted"]["types"] == ["DTensor"]


def test_patched_step_does_not_depend_on_torch_choice(generation):
    _, r = generation
    assert r["choice_independent"]["registered"] and r["choice_independent"]["unregistered"]
    # hyper type registered: the patch stands aside and torch's own foreach path runs on hyper DTensors
    assert r["choice_independent"]["registered_impl"] == ["_multi_tensor_adam"]
    assert r["choice_independent"]["registered_types"] == ["DTensor"]


def test_outside_context_and_other_optimizers_unchanged(generation):
    _, r = generation
    assert "contain parallel layout infer func" in r["outside_context"]   # "dose not" in the old generation
    plain = r["plain_under_skip"]      # no hyper param: torch's own choice, on the params themselves
    assert plain["equal"] and plain["impl"] == plain["ref_impl"] == ["_multi_tensor_adam"], plain
    assert r["sgd"] == {"untouched": True, "adam_calls": []}


def test_state_keeps_torch_format(generation):
    _, r = generation
    assert r["state"] == {"step": ["Tensor", []], "exp_avg": ["Tensor", [6, 4]], "exp_avg_sq": ["Tensor", [6, 4]]}


def test_veomni_wrap_optimizer_captured_before_apply(hyper_site, fixture_site):
    sites = [hyper_site, fixture_site("veomni_hyper_fork")]
    r = run_child("veomni_case", sites, env={"NPU_FSDP_PATCHES_DISABLE": "hp_skip_dispatch_adamw"})
    assert r["record"]["state"] == "disabled" and not r["before_apply_patched"]
    assert r["veomni"]["wrapped"] and r["veomni"]["equal"], r["veomni"]
    assert r["veomni"]["impl"] == ["_multi_tensor_adam"] and r["veomni"]["types"] == ["Tensor"]
    assert r["veomni"]["sgd_param"] == [-7.0, -7.0, -7.0]   # SGD ran its own step: 1 - 8 * 0.5 * 2


def test_stands_down_when_hyper_registers_its_dtensor(hyper_site):
    site = hyper_site
    module = site / "hyper_parallel" / "core" / "dtensor" / "dtensor.py"
    module.write_text(module.read_text() + "\n\nimport torch.optim.optimizer as _optimizer\n"
                      "_optimizer._foreach_supported_types.append(DTensor)  # the upstream fix\n")
    r = run_child("torch_choice_case", [site])
    assert r["record"]["state"] == "skipped" and "upstream has it" in r["record"]["note"], r["record"]
    assert not r["patched"]


@pytest.mark.parametrize("flags", ["default", "foreach=True", "fused=True"])
@pytest.mark.parametrize("mode", ["no_skip_adamw", "no_skip_zeros_like"])
def test_bit_exact_inside_skip_dispatch_with_no_skip(generation, mode, flags):
    """New generation's ``SkipDTensorDispatch(no_skip=...)`` (core/dtensor/dtensor.py, index commit 04eab380):
    with the AdamW ops named, or ``torch.zeros_like`` as hyper's own state initialisation names it, the
    patched step is bit-exact with torch's DTensor, on torch's implementation for the same flags."""
    name, r = generation
    if name == "old":
        pytest.skip("the old generation's SkipDTensorDispatch takes no no_skip (docs/hyper_parallel.md#11-generations)")
    case = r["no_skip"][f"{mode}_{flags}"]
    assert case["equal"] and case["impl"] == case["ref_impl"] and case["types"] == ["Tensor"], case


def test_no_skip_states_and_the_unpatched_step(generation):
    name, r = generation
    if name == "old":
        pytest.skip("the old generation's SkipDTensorDispatch takes no no_skip")
    cases = r["no_skip"]
    # zeros_like dispatches (named in both): the moments are hyper DTensors with the param's layout; step is a tensor
    for mode in ("no_skip_adamw", "no_skip_zeros_like"):
        assert cases[f"{mode}_state_types"] == ["hyper_parallel.DTensor", "torch.Tensor"], cases
    # without the patch, the named ops reach hyper's dispatcher, which has no layout for them
    assert "does not contain parallel layout infer func" in cases["reverted"], cases["reverted"]
