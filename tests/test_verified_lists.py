"""The matrix's `verified` lists say what the suite runs (issue 31): doctor's "in range but not verified
by the test suite" and explain's "Verified:" read them. A flavoured framework lists its versions per
flavour, since TENPU 0.1.0 and an NVIDIA TE release are different code; a version the suite ran only as a
test stand-in (TENPU, hyper-parallel, the veomni fork: not installable here) is marked as one, and the real
package of that version is not counted as verified (issue 40)."""
from npu_fsdp_patches.plan.decide import decide
from npu_fsdp_patches.plan.detect import Detected
from npu_fsdp_patches.plan.matrix import load_matrix
from npu_fsdp_patches.cli.render import explain_text
from npu_fsdp_patches.plan.settings import parse_settings
from tests.te_real import RELEASES
from tests.test_te_real import _TE_PATCHES, APPLIED, INITIALIZE_STATE

MATRIX = load_matrix()
#: te_initialize_state_compat on TE 2.20.2 runs in .ci/steps/50-megatron-py312.sh (megatron-core 0.19.2)
PY312_STEP = {"2.20.2"}


def _nvidia(patch):
    return {e.split(" [")[0] for e in MATRIX.patches[patch].verified["transformer_engine"] if e.endswith("[nvidia]")}


def test_flavoured_frameworks_list_each_verified_version_with_its_flavour():
    for name, spec in MATRIX.patches.items():
        for fw, entries in spec.verified.items():
            if MATRIX.frameworks[fw].flavors:
                assert all(e.replace(" (stand-in)", "").endswith(("[npu]", "[nvidia]")) for e in entries), (
                    name, fw, entries)


def test_te_patches_are_verified_on_exactly_the_releases_the_real_te_tests_run():
    assert set(APPLIED) <= set(RELEASES)
    for patch in _TE_PATCHES:
        verified = _nvidia(patch)
        assert verified <= set(APPLIED), (patch, verified - set(APPLIED))   # each one is run...
        assert {v for v, applied in APPLIED.items() if patch in applied} <= verified, patch   # ...and all of them
    assert _nvidia("te_initialize_state_compat") == set(INITIALIZE_STATE) | PY312_STEP


def test_the_readme_stack_te_2_13_with_megatron_is_verified_for_every_patch_it_enables():
    found = {name: Detected(name, False) for name in MATRIX.frameworks}
    found["torch"] = Detected("torch", True, "torch", "2.13.0")
    found["megatron_core"] = Detected("megatron_core", True, "megatron-core", "0.16.1")
    found["transformer_engine"] = Detected("transformer_engine", True, "transformer-engine", "2.13.0",
                                           flavor="nvidia")
    decisions = {n: decide(s, found, parse_settings({})) for n, s in MATRIX.patches.items()}
    enabled = {n: d for n, d in decisions.items() if d.enabled}
    assert set(enabled) == {"te_fused_adam_dtensor", "te_multi_tensor_apply_empty_tail", "te_initialize_state_compat",
                            "te_fused_adam_empty_scale", "te_fused_adam_empty_group_step"}
    assert {n: d.unverified for n, d in enabled.items()} == {n: () for n in enabled}
    # the same version of the other flavour is not verified
    found["transformer_engine"] = found["transformer_engine"]._replace(flavor="npu", version="2.13.0")
    assert decide(MATRIX.patches["te_fused_adam_dtensor"], found, parse_settings({})).unverified == (
        "transformer-engine 2.13.0 (npu)",)


def test_explain_names_the_flavour_of_each_verified_version():
    found = {name: Detected(name, False) for name in MATRIX.frameworks}
    text = explain_text(MATRIX.patches["te_fused_adam_dtensor"], None, found, None)
    flat = " ".join(line.strip() for line in text.splitlines())
    assert "; transformer_engine [npu] 0.1.0 (stand-in), [nvidia] 2.10.0, 2.11.0, 2.12.0, 2.13.0," in flat, flat


#: every version the suite runs only as a stand-in (tests/fixtures): TENPU's overlay, both hyper-parallel
#: generations, the veomni fork; everything else the suite verifies is the real registry package
STAND_INS = {("transformer_engine", "0.1.0 [npu]"), ("hyper_parallel", "0.1.0"), ("veomni", "0.1.11")}


def test_every_stand_in_is_marked_and_nothing_else_is():
    for name, spec in MATRIX.patches.items():
        for fw, entries in spec.verified.items():
            for entry in entries:
                base = entry.replace(" (stand-in)", "")
                assert entry.endswith(" (stand-in)") == ((fw, base) in STAND_INS), (name, fw, entry)


def test_a_real_package_of_a_stand_in_version_is_not_verified_and_doctor_says_why():
    found = {name: Detected(name, False) for name in MATRIX.frameworks}
    found["torch"] = Detected("torch", True, "torch", "2.13.0")
    found["transformer_engine"] = Detected("transformer_engine", True, "transformer-engine-npu", "0.1.0", flavor="npu")
    found["hyper_parallel"] = Detected("hyper_parallel", True, "hyper-parallel", "0.1.0")
    te = decide(MATRIX.patches["te_fused_adam_empty_group_step"], found, parse_settings({}))
    hyper = decide(MATRIX.patches["hp_skip_dispatch_adamw"], found, parse_settings({}))
    assert te.enabled and te.unverified == (
        "transformer-engine-npu 0.1.0 (npu); the suite ran only a stand-in of it",), te.unverified
    assert hyper.enabled and hyper.unverified == ("hyper-parallel 0.1.0; the suite ran only a stand-in of it",)
    text = " ".join(explain_text(MATRIX.patches["hp_skip_dispatch_adamw"], None, found, None).split())
    assert "; hyper_parallel 0.1.0 (stand-in); veomni 0.1.11 (stand-in) Upstream" in text, text
