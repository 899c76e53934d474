"""The torch gate of the shipped matrix, condition notes, and doctor's torch findings (pure, no torch)."""
import re

import pytest
from packaging.version import Version

from npu_fsdp_patches.decide import check_condition, decide
from npu_fsdp_patches.detect import Detected
from npu_fsdp_patches.errors import MatrixError
from npu_fsdp_patches.matrix import Condition, load_matrix, parse_matrix
from npu_fsdp_patches.settings import parse_settings
from npu_fsdp_patches.torch_support import SUPPORTED_TORCH, torch_findings, verified_torch
from tests.support import REPO_ROOT, VERIFIED_TORCH as VERIFIED

SHIPPED = load_matrix()


def torch_fw(version):
    return Detected("torch", True, "torch", version, source="metadata")


#: TE installs a gate may ask for: TENPU, NVTE before the DTensor fix, NVTE after it
TE_CANDIDATES = (("transformer-engine-npu", "0.1.0", "npu"), ("transformer-engine", "2.11.0", "nvidia"),
                 ("transformer-engine", "2.17.1", "nvidia"))


def everything_installed(torch_version, te=TE_CANDIDATES[0]):
    """Every framework of the shipped matrix installed, with ``te`` as the TE install."""
    dist, version, flavor = te
    out = {name: Detected(name, False) for name in SHIPPED.frameworks}
    out.update(torch=torch_fw(torch_version),
               transformer_engine=Detected("transformer_engine", True, dist, version, flavor=flavor),
               megatron_core=Detected("megatron_core", True, "megatron-core", "0.16.1"),
               hyper_parallel=Detected("hyper_parallel", True, "hyper-parallel", "0.1.0"),
               veomni=Detected("veomni", True, "veomni", "0.1.12"))
    return out


def installed_for(name, torch_version):
    """Frameworks at ``torch_version`` with the first TE install under which ``name`` applies on 2.13."""
    spec = SHIPPED.patches[name]
    te = next(te for te in TE_CANDIDATES
              if decide(spec, everything_installed("2.13.0", te), parse_settings({})).enabled)
    return everything_installed(torch_version, te)


def test_every_patch_gates_on_torch_2_6_and_lists_the_verified_torch():
    assert verified_torch(SHIPPED) == VERIFIED
    for name, spec in SHIPPED.patches.items():
        assert list(spec.verified["torch"]) == VERIFIED, name
        for alternative in spec.gate:
            torch_conditions = [c for c in alternative if c.framework == "torch"]
            assert len(torch_conditions) == 1, (name, alternative)
            spec_set = torch_conditions[0].version
            assert not spec_set.contains("2.5.1"), name
        accepted = {v for v in VERIFIED if any(c.version.contains(v) for alt in spec.gate
                                                for c in alt if c.framework == "torch")}
        assert accepted == set(VERIFIED), name
    assert SUPPORTED_TORCH.contains("2.6.0") and not SUPPORTED_TORCH.contains("2.5.1")


@pytest.mark.parametrize("version", ["2.5.1", "2.4.0+cpu"])
def test_unsupported_torch_disables_every_patch_naming_it(version):
    frameworks = everything_installed(version)
    settings = parse_settings({})
    for name, spec in SHIPPED.patches.items():
        decision = decide(spec, installed_for(name, version), settings)
        assert not decision.enabled and f"torch {version} does not match" in decision.reason, \
            (name, decision.reason)
    (finding,) = torch_findings(frameworks["torch"], SHIPPED)
    assert f"torch {version} is unsupported" in finding and ">=2.6" in finding


@pytest.mark.parametrize("version", ["2.6.0+cu124", "2.7.1+cu126", "2.10.0", "2.13.0+cpu"])
def test_verified_torch_is_enabled_verified_and_quiet(version):
    frameworks = everything_installed(version)
    for name, spec in SHIPPED.patches.items():
        decision = decide(spec, installed_for(name, version), parse_settings({}))
        assert decision.enabled, (name, decision.reason)
        assert not any(u.startswith("torch") for u in decision.unverified), (name, decision.unverified)
    assert torch_findings(frameworks["torch"], SHIPPED) == []


def test_unverified_torch_in_range_warns():
    frameworks = everything_installed("2.8.0+cu128")
    (finding,) = torch_findings(frameworks["torch"], SHIPPED)
    assert finding == ("torch 2.8.0+cu128 is not a verified torch version (the suite runs on torch "
                       "2.6.0, 2.7.1, 2.10.0, 2.13.0)")
    decision = decide(SHIPPED.patches["hp_skip_dispatch_adamw"], frameworks, parse_settings({}))
    assert decision.enabled and "torch 2.8.0+cu128" in decision.unverified
    assert torch_findings(Detected("torch", False), SHIPPED) == []


@pytest.mark.parametrize("version, note", [
    ("2.6.0", "AdamW steps through torch.optim.adamw:adamw"), ("2.7.1", None), ("2.13.0", None)])
def test_skip_dispatch_decision_says_how_torch_2_6_is_covered(version, note):
    decision = decide(SHIPPED.patches["hp_skip_dispatch_adamw"], everything_installed(version),
                      parse_settings({}))
    assert decision.enabled
    assert (note in decision.reason) if note else ("adamw" not in decision.reason)


@pytest.mark.parametrize("version, muon", [("2.6.0", False), ("2.7.1", False), ("2.10.0", True),
                                           ("2.13.0", True)])
def test_main_params_decision_names_missing_muon(version, muon):
    decision = decide(SHIPPED.patches["hp_fp32_main_params"], everything_installed(version),
                      parse_settings({}))
    assert decision.enabled
    assert ("no torch.optim.Muon before torch 2.9" in decision.reason) is not muon, decision.reason
    assert f"torch {version} matches" in decision.reason


def test_condition_note_only_when_it_holds():
    cond = Condition("torch", True, SHIPPED.patches["hp_fp32_main_params"].gate[1][1].version, None, "n")
    assert check_condition(cond, torch_fw("2.7.1")) == (True, "torch 2.7.1 matches <2.9,>=2.6: n")
    assert check_condition(cond, torch_fw("2.9.0"))[1] == "torch 2.9.0 does not match <2.9,>=2.6"


def test_condition_note_must_be_a_string():
    text = """\
schema_version: 1
frameworks: {torch: {distributions: [torch], module: torch}}
patches:
  p: {summary: s, targets: ["a:b"], gate: [{torch: {version: ">=2.6", note: [1]}}]}
"""
    with pytest.raises(MatrixError, match=r"patches\.p\.gate\[0\]\.torch\.note.*expected a string"):
        parse_matrix(text)


def test_ci_runs_every_verified_torch():
    """The README test command's torch plus .ci/older-torch.env's are exactly the matrix's verified torch."""
    readme = (REPO_ROOT / "README.md").read_text()
    readme_torch = re.findall(r"pip install torch==(\S+) -e '\.\[test\]'", readme)
    env = (REPO_ROOT / ".ci" / "older-torch.env").read_text()
    older = re.search(r'^OLDER_TORCH_VERSIONS="([^"]*)"', env, re.M).group(1).split()
    assert sorted(set(readme_torch[:1] + older), key=Version) == VERIFIED
