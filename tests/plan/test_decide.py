"""Table tests of the pure decision functions."""
import pytest

from npu_fsdp_patches.plan.decide import check_condition, decide
from npu_fsdp_patches.plan.detect import Detected
from npu_fsdp_patches.plan.matrix import parse_matrix
from npu_fsdp_patches.plan.settings import parse_settings

MATRIX = parse_matrix("""\
schema_version: 1
frameworks:
  transformer_engine: {distributions: [transformer-engine], module: transformer_engine}
  megatron_core: {distributions: [megatron-core], module: megatron}
  hyper_parallel: {distributions: [hyper-parallel], module: hyper_parallel}
patches:
  te_patch:
    summary: s
    targets: ["a:b"]
    gate:
      - transformer_engine: {flavor: npu}
      - transformer_engine: {flavor: nvidia, version: ">=2.10,<2.12"}
    verified: {transformer_engine: ["2.11.0", "2.2.0"]}
  shim:
    summary: s
    targets: ["a:b"]
    gate:
      - megatron_core: {version: ">=0.11"}
        transformer_engine: {version: ">=2.1"}
    verified: {megatron_core: ["0.16.1"], transformer_engine: ["2.11.0"]}
  no_hp:
    summary: s
    targets: ["a:b"]
    gate:
      - hyper_parallel: {installed: false}
""")


KEYS = {"te": "transformer_engine", "mc": "megatron_core", "hp": "hyper_parallel"}


def fw(short, version=None, flavor=None):
    name = KEYS[short]
    if version is None:
        return Detected(name, False)
    return Detected(name, True, name.replace("_", "-"), version, flavor=flavor)


def frameworks(te=None, mc=None, hp=None):
    return {KEYS["te"]: te or fw("te"), KEYS["mc"]: mc or fw("mc"), KEYS["hp"]: hp or fw("hp")}


@pytest.mark.parametrize("patch, fws, env, enabled, reason, verified", [
    ("te_patch", frameworks(), {}, False, "transformer-engine not installed", None),
    ("te_patch", frameworks(te=fw("te", "2.2.0", "npu")), {}, True,
     "transformer-engine 2.2.0 (npu) installed", True),
    ("te_patch", frameworks(te=fw("te", "2.11.0", "nvidia")), {}, True,
     "transformer-engine 2.11.0 (nvidia) matches <2.12,>=2.10", True),
    ("te_patch", frameworks(te=fw("te", "2.10.1", "nvidia")), {}, True,
     "transformer-engine 2.10.1 (nvidia) matches <2.12,>=2.10", False),
    ("te_patch", frameworks(te=fw("te", "2.14.0", "nvidia")), {}, False,
     "transformer-engine 2.14.0 (nvidia) is not the npu flavor / "
     "transformer-engine 2.14.0 (nvidia) does not match <2.12,>=2.10", None),
    ("shim", frameworks(te=fw("te", "2.11.0"), mc=fw("mc", "0.16.1")), {}, True,
     "megatron-core 0.16.1 matches >=0.11; transformer-engine 2.11.0 matches >=2.1", True),
    ("shim", frameworks(te=fw("te", "2.0.0"), mc=fw("mc", "0.16.1")), {}, False,
     "transformer-engine 2.0.0 does not match >=2.1", None),
    ("shim", frameworks(te=fw("te", "2.11.0"), mc=fw("mc", "0.10.0")), {}, False,
     "megatron-core 0.10.0 does not match >=0.11", None),
    ("shim", frameworks(te=fw("te", "2.11.0"), mc=fw("mc", "core_r0.12.1")), {}, False,
     "megatron-core version 'core_r0.12.1' is not a PEP 440 version", None),
    ("shim", frameworks(te=fw("te", "2.11.0"), mc=fw("mc", "0.16.1")),
     {"NPU_FSDP_PATCHES_DISABLE": "shim"}, False, "disabled by NPU_FSDP_PATCHES_DISABLE", None),
    ("shim", frameworks(), {"NPU_FSDP_PATCHES_ENABLE": "shim"}, True, "forced by NPU_FSDP_PATCHES_ENABLE", None),
    ("shim", frameworks(te=fw("te", "2.11.0"), mc=fw("mc", "0.16.1")), {"NPU_FSDP_PATCHES": "0"}, False,
     "NPU_FSDP_PATCHES=0 (kill switch)", None),
    ("no_hp", frameworks(), {}, True, "hyper-parallel absent", None),
    ("no_hp", frameworks(hp=fw("hp", "0.1.0")), {}, False, "hyper-parallel 0.1.0 is installed", None),
])
def test_decision_table(patch, fws, env, enabled, reason, verified):
    d = decide(MATRIX.patches[patch], fws, parse_settings(env))
    assert (d.enabled, d.reason, d.verified) == (enabled, reason, verified)


def test_unverified_lists_the_version():
    d = decide(MATRIX.patches["te_patch"], frameworks(te=fw("te", "2.10.1", "nvidia")), parse_settings({}))
    assert d.unverified == ("transformer-engine 2.10.1 (nvidia)",)


def test_prerelease_and_local_versions_match():
    cond = MATRIX.patches["shim"].gate[0][0]
    assert check_condition(cond, fw("mc", "0.18.0rc1"))[0] is True
    assert check_condition(MATRIX.patches["shim"].gate[0][1], fw("te", "2.13.0+npu"))[0] is True


def test_apply_builds_its_explicit_decision_here_verified_over_every_gated_framework():
    from npu_fsdp_patches.plan.decide import requested_by_apply
    d = requested_by_apply(MATRIX.patches["te_patch"], frameworks(te=fw("te", "2.10.1", "nvidia")))
    assert d == (True, "requested by apply()", True, False, ("transformer-engine 2.10.1 (nvidia)",))
    d = requested_by_apply(MATRIX.patches["shim"], frameworks())
    assert (d.enabled, d.explicit, d.verified, d.unverified) == (True, True, True, ())


# -- versions at gate edges (docs/design.md#341-versions-at-gate-edges) ---------------------------------

def _shipped_bounds():
    """(framework, X) for every version bound of the shipped matrix, and every condition by framework."""
    from npu_fsdp_patches.plan.matrix import load_matrix
    matrix = load_matrix()
    conditions = {}
    for spec in matrix.patches.values():
        for alternative in spec.gate:
            for cond in alternative:
                if cond.version is not None:
                    conditions.setdefault(cond.framework, []).append(cond)
    bounds = sorted({(name, s.version) for name, conds in conditions.items() for c in conds for s in c.version})
    return bounds, conditions


BOUNDS, CONDITIONS = _shipped_bounds()


def _variants(x):
    release = x if x.count(".") >= 2 else x + ".0"
    return [f"{release}.dev0", f"{release}.dev0+g1234abc", f"{release}rc1", f"{release}a0+git5f3a1b2",
            f"{release}.post1", f"{release}+local"]


@pytest.mark.parametrize("framework, bound", BOUNDS)
def test_every_shipped_bound_puts_dev_rc_post_and_local_builds_on_the_side_of_the_release(framework, bound):
    """A pre-release, post-release or local build of X decides exactly like X on every condition, so of
    a split gate (``<X`` in one place, ``>=X`` in another) exactly one side holds."""
    release = bound if bound.count(".") >= 2 else bound + ".0"
    same = fw("te", release)._replace(name=framework)
    for version in _variants(bound):
        build = same._replace(version=version)
        for cond in CONDITIONS[framework]:
            cond = cond._replace(flavor=None)
            assert check_condition(cond, build)[0] == check_condition(cond, same)[0], (version, str(cond.version))
        below = [c for c in CONDITIONS[framework] if any(s.operator == "<" and s.version == bound for s in c.version)]
        above = [c for c in CONDITIONS[framework] if any(s.operator == ">=" and s.version == bound for s in c.version)]
        if below and above:
            sides = [check_condition(c._replace(flavor=None), build)[0] for c in below + above]
            assert sides.count(True) == len(above) and not any(sides[:len(below)]), (version, sides)


def test_the_split_gates_named_in_the_issue_land_on_one_side():
    from npu_fsdp_patches.plan.matrix import load_matrix
    matrix = load_matrix()

    def shipped(torch="2.13.0", te=None, hp=None):
        found = {name: Detected(name, False) for name in matrix.frameworks}
        found["torch"] = Detected("torch", True, "torch", torch)
        if te:
            found["transformer_engine"] = Detected("transformer_engine", True, "transformer-engine", te,
                                                   flavor="nvidia")
        if hp:
            found["hyper_parallel"] = Detected("hyper_parallel", True, "hyper-parallel", hp)
        return found

    def on(patch, found):
        return decide(matrix.patches[patch], found, parse_settings({}))

    dev = shipped(te="2.14.0.dev0+g1234abc")
    assert on("te_fused_adam_dtensor", dev).enabled is False
    scale = on("te_fused_adam_empty_scale", dev)
    assert scale.enabled and "2.14.0.dev0+g1234abc (nvidia), counted as 2.14.0, matches >=2.14" in scale.reason
    assert scale.verified is False
    assert on("hp_fp32_main_params", shipped(torch="2.9.0a0+git5f3a1b2", hp="0.1.0")).reason.startswith(
        "hyper-parallel 0.1.0 installed; torch 2.9.0a0+git5f3a1b2, counted as 2.9.0, matches >=2.9")
    assert on("hp_skip_dispatch_adamw", shipped(torch="2.7.0a0", hp="0.1.0")).enabled
    assert on("hp_skip_dispatch_adamw", shipped(torch="2.6.0rc1", hp="0.1.0")).enabled


VERSIONS = ["2.14.0", "2.14", "2.14.0.dev0+g1234abc", "2.13.9rc2", "2.9.0a0+git5f3a1b2", "2.8.0.post2",
            "2.13.0+cpu", "1!2.0", "2.14.0-rc1", "v2.14.0", "0.18.0rc1", "2.14.0.post1.dev3", "2.6"]
BOUNDS_TEXT = [">=2.14", "<2.14", ">=2.10,<2.14", "==2.14", "!=2.14.0", ">2.13", "<=2.13.9", "~=2.13",
               "==2.*", ">=2.6,<2.7", ">=0.11"]


@pytest.mark.parametrize("version", VERSIONS)
def test_the_release_rule_without_packaging_agrees_with_packaging(version):
    """versions.py decides canonical versions and release-only bounds without packaging; every answer
    equals packaging's on the release segment."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    from npu_fsdp_patches.plan.versions import VersionBounds, release_of
    parsed = Version(version)
    expected = ".".join(map(str, parsed.release))
    expected = f"{parsed.epoch}!{expected}" if parsed.epoch else expected
    assert release_of(version) == expected
    for text in BOUNDS_TEXT:
        bounds = VersionBounds(str(SpecifierSet(text)))
        assert bounds.holds_for(release_of(version)) == SpecifierSet(text).contains(
            Version(expected), prereleases=True), (version, text)
        assert bounds == SpecifierSet(text) and str(bounds) == str(SpecifierSet(text))


def test_a_version_that_is_not_pep440_is_named_as_such():
    d = decide(MATRIX.patches["shim"], frameworks(te=fw("te", "2.11.0"), mc=fw("mc", "core_r0.12.1")),
               parse_settings({}))
    assert d.reason == "megatron-core version 'core_r0.12.1' is not a PEP 440 version"
