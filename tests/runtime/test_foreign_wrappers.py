"""Our patches next to other patchers (issue 23 items 1-2): a wrapper stacked on ours is never silently
removed (revert refuses, naming it, and ours stays applied beneath it), and a target overwritten after
apply is reported with the replacement's module and qualified name and whether it wraps ours.

MindSpeed's patch manager is the stand-in tests/fixtures/mindspeed_patch_manager (upstream file:line in
its docstring), activated after our plugin and before it.
"""
from __future__ import annotations

import pytest

from tests.support import install_fixture, run_case

PATCH = "hp_skip_dispatch_adamw"


@pytest.fixture(scope="module")
def sites(tmp_path_factory):
    base = tmp_path_factory.mktemp("sites")
    return [install_fixture("hyper_parallel_new", base), install_fixture("mindspeed_patch_manager", base)]


def test_revert_refuses_to_drop_a_functools_or_wrapt_wrapper_stacked_on_ours(sites):
    out = run_case("tests.children.foreign_wrappers:stacked_case", paths=sites[:1])
    for kind, name in (("functools", "tests.children.foreign_wrappers.profile.<locals>.timed ("),
                       ("wrapt", "wrapt FunctionWrapper calling tests.children.foreign_wrappers.wrapt_timed (")):
        seen = out[kind]
        assert seen["ours"] and seen["profiled"] == [kind], seen
        assert seen["state"] == seen["state_after"] == "applied", seen
        assert seen["kept"], "revert removed the foreign wrapper"
        assert seen["refused"].startswith(f"patch {PATCH} not reverted: torch.optim.adam:adam is wrapped by "
                                          + name), seen["refused"]
        assert "ours stays applied" in seen["refused"] and name in seen["note"], seen
    assert out["revert_after"] == [None, "reverted", False]


def test_mindspeed_after_our_plugin_wraps_ours_and_revert_refuses(sites):
    out = run_case("tests.children.foreign_wrappers:mindspeed_case", args={"plugin_first": True}, paths=sites)
    wrapper = "mindspeed.megatron_adaptor.adam_profile_wrapper.<locals>.wrapper ("
    assert out["applied"] == "applied" and out["mindspeed_ran"] == ["adam"]
    assert out["first"]["state"] == "applied" and wrapper in out["first"]["note"], out["first"]
    assert out["refused"].startswith(f"patch {PATCH} not reverted: torch.optim.adam:adam is wrapped by {wrapper}")
    # repatch() removes its wrapper (putting ours back) and stacks a new one on ours: still applied
    assert out["after_repatch"]["state"] == "applied" and wrapper in out["after_repatch"]["note"]
    assert out["revert"] is not None and out["mindspeed_kept"] and out["mindspeed_ran_after"] == ["adam"]
    assert out["state_end"] == "applied"


def test_mindspeed_before_our_plugin_repatch_overwrites_ours_and_is_named(sites):
    out = run_case("tests.children.foreign_wrappers:mindspeed_case", args={"plugin_first": False}, paths=sites,
                   env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert out["applied"] == "applied" and out["first"]["state"] == "applied", out
    after = out["after_repatch"]
    assert after["state"] == "failed", after
    assert after["error"].startswith("no longer installed at torch.optim.adam:adam"), after["error"]
    assert ("torch.optim.adam:adam now holds mindspeed.megatron_adaptor.adam_profile_wrapper.<locals>.wrapper ("
            in after["error"]), after["error"]
    assert "which does not wrap ours" in after["error"] and after["doctor_reason"] == after["error"]
    # our revert never removes MindSpeed's function
    assert out["revert"] is None and out["mindspeed_kept"] and out["mindspeed_ran_after"] == ["adam"]
