"""Every replacement the plugin installs is indistinguishable from the original (issue 17 items 1-2).

For each shipped patch's targets, in fresh interpreters with the target framework's stand-in installed
and autoload on: ``inspect.signature``, name/qualified name/module/docstring, the innermost
``__wrapped__`` and pickling by reference equal the unpatched run's, and the installed object is ours
with ``__wrapped__`` = the original. hp_skip_dispatch_adamw also checks torch.compile (graph breaks,
frames, result bits) and that ``npu_fsdp_patches.optim`` and torch's plain Adam/AdamW give the same bits
with the patch applied before or after the optim import.
"""
from __future__ import annotations

import pytest

from tests.core_demo import demo_matrix
from tests.support import install_fixture, run_case
from tests.te_real import require_te_site, require_tenpu_site

HYPER_TARGETS = ["torch.optim.adam:adam", "torch.optim.adamw:adamw", "torch.optim.adamw:adam",
                 "torch.optim._functional:adam", "torch.optim._functional:adamw",
                 "hyper_parallel.trainer.base:BaseTrainer.__init__",
                 "hyper_parallel.trainer.base:BaseTrainer._build_optimizer",
                 "hyper_parallel.trainer.base:BaseTrainer.save_checkpoint",
                 "hyper_parallel.trainer.base:BaseTrainer.load_checkpoint"]
_FUSED = "transformer_engine.pytorch.optimizers.fused_adam:FusedAdam."
TE_TARGETS = [_FUSED + m for m in ("step", "_initialize_state", "get_unscaled_state", "set_scaled_state",
                                   "state_dict", "load_state_dict", "_apply_scale", "initialize_state")] + [
    "transformer_engine.pytorch.optimizers.multi_tensor_apply:MultiTensorApply.__call__"]
TE_PATCHES = ("te_fused_adam_dtensor,te_fused_adam_empty_scale,te_multi_tensor_apply_empty_tail,"
              "te_initialize_state_compat")
DESCRIPTOR_TARGETS = ["demo_target:Engine.build", "demo_target:Engine.check"]
#: API changes on purpose, so the replacement declares its own signature (``__signature__``):
#: te_initialize_state_compat makes store_param_remainders optional; te_fused_adam_dtensor gives
#: TE < 2.13 the ``skip_unscale`` argument of TE >= 2.13 (docs/te_fused_adam.md#13-method-signatures)
CHANGES_SIGNATURE = {_FUSED + "initialize_state": "(self, param, store_param_remainders=None)",
                     _FUSED + "get_unscaled_state": "(self, param, state_name, skip_unscale: 'bool' = False)"}
OFF = {"NPU_FSDP_PATCHES": "0"}
#: TENPU's FusedAdam inherits these from NVTE's base class (tests/fixtures/te_npu_prefix)
INHERITED = {_FUSED + m for m in ("set_scaled_state", "state_dict", "load_state_dict", "_initialize_state",
                                  "get_unscaled_state", "_apply_scale", "initialize_state")}


@pytest.fixture(scope="module")
def hyper(tmp_path_factory):
    from tests.support import install_fixture
    site = install_fixture("hyper_parallel_new", tmp_path_factory.mktemp("hyper"))
    args = {"targets": HYPER_TARGETS}
    on = {"NPU_FSDP_PATCHES_ENABLE": "hp_fp32_main_params"}   # its gate needs a config the stand-in lacks
    return {
        "off": run_case("tests.children.transparent:hyper_case", args=args, paths=[site], env=OFF, timeout=600),
        "on": run_case("tests.children.transparent:hyper_case", args=args, paths=[site], env=on, timeout=600),
        "late": run_case("tests.children.transparent:hyper_case", paths=[site], timeout=600,
                         args={**args, "apply_after_import": True, "compile_too": False},
                         env={**on, "NPU_FSDP_PATCHES_DISABLE": "hp_skip_dispatch_adamw"}),
    }


def _assert_transparent(off: dict, on: dict, changes_signature=frozenset()) -> None:
    assert not off["applied"]
    applied = set(on["applied"])
    for symbol, seen in on.items():
        if symbol == "applied":
            continue
        if symbol not in applied:   # stood down on this framework version (checked by the caller)
            assert not seen["ours"], symbol
            continue
        unpatched = off[symbol]
        assert seen["ours"] and seen["wraps_original"], (symbol, seen)
        assert not unpatched["ours"], symbol
        names = unpatched["names"]
        if symbol in INHERITED:   # named where it is installed, so that it pickles (as the original does)
            names = [names[0], symbol.partition(":")[2], symbol.partition(":")[0], names[3]]
        assert seen["names"] == names, (symbol, seen["names"], names)
        for key in ("innermost", "pickle"):
            assert seen[key] == unpatched[key], (symbol, key, seen[key], unpatched[key])
        if symbol not in changes_signature:
            assert seen["signature"] == unpatched["signature"], (symbol, seen["signature"], unpatched["signature"])
        assert unpatched["pickle"] == "same object", (symbol, unpatched["pickle"])


@pytest.mark.parametrize("run", ["on", "late"])
def test_hyper_targets_are_transparent(hyper, run):
    assert set(HYPER_TARGETS) <= set(hyper[run]["surface"]["applied"])
    _assert_transparent(hyper["off"]["surface"], hyper[run]["surface"])


@pytest.mark.parametrize("run", ["on", "late"])
def test_optim_and_torch_adam_give_the_same_bits_in_either_import_order(hyper, run):
    off, on = hyper["off"]["optim"], hyper[run]["optim"]
    assert (off["state"], on["state"]) == ("disabled", "applied")
    assert on["one_step"] == off["one_step"] == pytest.approx(0.85)   # 0.90 was Adam's L2 decay
    for name, bits in off["bits"].items():
        assert on["bits"][name] == bits, name


def test_the_bit_comparison_catches_one_ulp(hyper):
    """Negative control: one ulp off in one element of one param is a difference."""
    bits = hyper["off"]["optim"]["bits"]["foreach_adamw_step/AdamW"]
    nudged = [list(t) for t in bits]
    nudged[0][3] += 1
    assert nudged != bits


def test_compiled_steps_break_and_compute_as_unpatched(hyper):
    off, on = hyper["off"]["compiled"], hyper["on"]["compiled"]
    for flag in ("fused", "foreach"):
        assert on[flag] == off[flag], (flag, {k: v for k, v in on[flag].items() if k != "bits"},
                                       {k: v for k, v in off[flag].items() if k != "bits"})


@pytest.mark.parametrize("flavor", ["nvidia", "tenpu"])
def test_te_targets_are_transparent(flavor):
    site = require_te_site("2.11.0") if flavor == "nvidia" else require_tenpu_site()
    targets = TE_TARGETS + ([_FUSED + "_check_unsupported_param_type"] if flavor == "tenpu" else [])
    off = run_case("tests.children.transparent:surface", args={"targets": targets}, paths=[site], env=OFF)
    on = run_case("tests.children.transparent:surface", args={"targets": targets}, paths=[site],
                  env={"NPU_FSDP_PATCHES_ENABLE": TE_PATCHES})
    if flavor == "tenpu":   # TENPU's initialize_state already has the default, and its other fixes differ
        assert {_FUSED + m for m in ("step", "get_unscaled_state", "_check_unsupported_param_type")} <= set(
            on["applied"]), on["applied"]
    else:
        assert set(TE_TARGETS) <= set(on["applied"]), on["applied"]
    applied = set(on["applied"])
    _assert_transparent(off, on, CHANGES_SIGNATURE)
    for symbol, declared in CHANGES_SIGNATURE.items():
        if symbol in applied:
            assert on[symbol]["signature"] == declared != off[symbol]["signature"], (symbol, on[symbol])


def test_classmethod_and_staticmethod_replacements_are_transparent(tmp_path):
    """No shipped patch targets a descriptor now: the core_demo patch demo_descriptors does."""
    site = install_fixture("core_demo", tmp_path)
    matrix = demo_matrix(tmp_path / "descriptors.yaml", """  demo_descriptors:
    summary: forward Engine.build (classmethod) and Engine.check (staticmethod)
    targets: ["demo_target:Engine.build", "demo_target:Engine.check"]
    gate:
      - demo: {version: ">=1.0"}
""")
    args = {"targets": DESCRIPTOR_TARGETS}
    env = {"NPU_FSDP_PATCHES_MATRIX": str(matrix)}
    off = run_case("tests.children.transparent:surface", args=args, paths=[site], env={**env, **OFF})
    on = run_case("tests.children.transparent:surface", args=args, paths=[site], env=env)
    assert set(DESCRIPTOR_TARGETS) <= set(on["applied"])
    assert on["demo_target:Engine.build"]["signature"] == "(x: int, *, scale: int = 1) -> 'Engine'"
    _assert_transparent(off, on)
