"""The torch gate of the shipped matrix, its one home (the matrix's defaults), condition notes, and
doctor's torch findings (pure, no torch)."""
import os
import re
import subprocess
import sys

import pytest
import yaml
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from npu_fsdp_patches.plan.decide import check_condition, decide
from npu_fsdp_patches.plan.detect import Detected
from npu_fsdp_patches.errors import MatrixError
from npu_fsdp_patches.plan.matrix import Condition, load_matrix, parse_matrix
from npu_fsdp_patches.plan.settings import parse_settings
from npu_fsdp_patches.plan.torch_support import supported_torch, torch_findings, verified_torch
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
    assert verified_torch(SHIPPED) == VERIFIED == sorted(VERIFIED, key=Version)
    assert supported_torch(SHIPPED) == SpecifierSet(">=2.6")
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


def test_the_torch_floor_and_verified_torch_are_written_once():
    """Only the matrix's defaults name the torch floor and the verified torch; no patch repeats them."""
    raw = yaml.safe_load((REPO_ROOT / "compat_matrix.yaml").read_text())
    assert raw["defaults"] == {"gate": {"torch": {"version": ">=2.6"}}, "verified": {"torch": VERIFIED}}
    for name, patch in raw["patches"].items():
        assert "torch" not in (patch.get("verified") or {}), name
        for alternative in patch["gate"]:
            assert ">=2.6" not in str(alternative.get("torch", {}).get("version", "")), (name, alternative)


DEFAULTS = """\
defaults:
  gate: {torch: {version: ">=2.6"}}
  verified: {torch: ["2.6.0", "2.13.0"]}
"""
DEFAULTS_DEMO = "schema_version: 1\n" + DEFAULTS + """\
frameworks:
  torch: {distributions: [torch], module: torch}
  demo: {distributions: [demo], module: demo}
patches:
  plain: {summary: s, targets: ["a:b"], gate: [{demo: {installed: true}}]}
  own:
    summary: s
    targets: ["a:b"]
    gate:
      - {demo: {installed: true}, torch: {version: ">=2.9"}}
      - {demo: {installed: true}, torch: {version: "<2.9", note: "n"}}
    verified: {torch: ["2.13.0"], demo: ["1.0"]}
"""


def test_defaults_are_merged_into_every_patch():
    matrix = parse_matrix(DEFAULTS_DEMO)
    plain, own = matrix.patches["plain"], matrix.patches["own"]
    assert [(c.framework, str(c.version or "")) for c in plain.gate[0]] == [("demo", ""), ("torch", ">=2.6")]
    assert dict(plain.verified) == {"torch": ("2.6.0", "2.13.0")}
    # an alternative's own torch condition must match the floor too; a lower bound above it implies it
    assert [str(alt[1].version) for alt in own.gate] == [">=2.9", "<2.9,>=2.6"]
    assert own.gate[1][1].note == "n"
    assert dict(own.verified) == {"torch": ("2.13.0",), "demo": ("1.0",)}   # its own list wins
    frameworks = {"torch": torch_fw("2.5.1"), "demo": Detected("demo", True, "demo", "1.0", source="metadata")}
    for spec in (plain, own):
        assert not decide(spec, frameworks, parse_settings({})).enabled
    assert supported_torch(matrix) == SpecifierSet(">=2.6")


@pytest.mark.parametrize("old, new, key_path", [
    ('gate: {torch: {version: ">=2.6"}}', 'gate: {torch: {version: ">=2.6"}}\n  colour: red', "defaults.colour"),
    ('gate: {torch: {version: ">=2.6"}}', 'gate: {nothere: {version: ">=2.6"}}', "defaults.gate.nothere"),
    ('verified: {torch: ["2.6.0", "2.13.0"]}', "verified: {torch: [2.6]}", "defaults.verified.torch[0]"),
    ('{demo: {installed: true}, torch: {version: ">=2.9"}}', "{torch: {installed: false}}",
     "patches.own.gate[0].torch"),
])
def test_bad_defaults_name_their_key_path(old, new, key_path):
    with pytest.raises(MatrixError) as info:
        parse_matrix(DEFAULTS_DEMO.replace(old, new, 1), "m.yaml")
    assert info.value.key_path == key_path


def test_a_matrix_without_defaults_has_no_torch_floor_and_a_failed_one_falls_back_to_the_shipped():
    bare = parse_matrix(DEFAULTS_DEMO.replace(DEFAULTS, ""))
    assert supported_torch(bare) is None and torch_findings(torch_fw("2.5.1"), bare) == [
        "torch 2.5.1 is not a verified torch version (the suite runs on torch 2.13.0)"]
    assert torch_findings(torch_fw("2.5.1"), None) == torch_findings(torch_fw("2.5.1"), SHIPPED)


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


@pytest.mark.parametrize("version", [*VERIFIED, "2.6.0+cu124", "2.13.0+cpu", "2.15.0+cu130"])
def test_verified_torch_is_enabled_verified_and_quiet(version):
    frameworks = everything_installed(version)
    for name, spec in SHIPPED.patches.items():
        decision = decide(spec, installed_for(name, version), parse_settings({}))
        assert decision.enabled, (name, decision.reason)
        assert not any(u.startswith("torch") for u in decision.unverified), (name, decision.unverified)
    assert torch_findings(frameworks["torch"], SHIPPED) == []


@pytest.mark.parametrize("version", ["2.9.0+cu128", "2.16.0"])
def test_unverified_torch_in_range_warns(version):
    frameworks = everything_installed(version)
    (finding,) = torch_findings(frameworks["torch"], SHIPPED)
    assert finding == (f"torch {version} is not a verified torch version (the suite runs on torch "
                       "2.6.0, 2.7.1, 2.8.0, 2.9.1, 2.10.0, 2.11.0, 2.12.1, 2.13.0, 2.14.1, 2.15.0)")
    decision = decide(SHIPPED.patches["hp_skip_dispatch_adamw"], frameworks, parse_settings({}))
    assert decision.enabled and f"torch {version}" in decision.unverified
    assert torch_findings(Detected("torch", False), SHIPPED) == []


@pytest.mark.parametrize("version, note", [
    ("2.6.0", "AdamW steps through torch.optim.adamw:adamw"), ("2.7.1", None), ("2.13.0", None)])
def test_skip_dispatch_decision_says_how_torch_2_6_is_covered(version, note):
    decision = decide(SHIPPED.patches["hp_skip_dispatch_adamw"], everything_installed(version),
                      parse_settings({}))
    assert decision.enabled
    assert (note in decision.reason) if note else ("adamw" not in decision.reason)


@pytest.mark.parametrize("version, muon", [("2.6.0", False), ("2.8.0", False), ("2.9.1", True),
                                           ("2.15.0", True)])
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


def ci_env(*names):
    """``names`` as .ci/older-torch.env sets them (it reads the verified torch from the matrix)."""
    script = ". .ci/older-torch.env && " + " && ".join(f'echo "${name}"' for name in names)
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    proc = subprocess.run(["bash", "-c", script], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=60, check=True)
    return [line.split() for line in proc.stdout.splitlines()]


def test_ci_runs_every_verified_torch():
    """The README test command's torch plus the older torch CI derives from the matrix are exactly the
    verified torch; the oldest and the newest run the full torch-sensitive list and the compiled steps."""
    readme_torch = re.findall(r"pip install torch==(\S+) -e '\.\[test\]'", (REPO_ROOT / "README.md").read_text())
    run_torch = re.findall(r"pip install torch==(\S+) -e '\.\[test\]'", (REPO_ROOT / ".ci" / "run").read_text())
    (main,), older, full, above_cap, edge = ci_env("MAIN_TORCH", "OLDER_TORCH_VERSIONS", "FULL_LIST_TORCH",
                                                   "ABOVE_PIP_CAP_TORCH", "EDGE_TORCH")
    assert readme_torch[:1] == run_torch == [main]
    assert sorted([main, *older], key=Version) == VERIFIED and main not in older
    assert {VERIFIED[0], VERIFIED[-1]} <= set(full) <= set(older) and set(above_cap) <= set(older)
    assert edge == [VERIFIED[0], VERIFIED[-1]]   # the compiled-step tests' torch besides the README's
