"""doctor's torch finding end to end: quiet on the installed (verified) torch, a warning on one it never verified.

CI runs this file on every verified torch (the README test command on 2.13.0, .ci/steps/60-older-torch.sh
on the older ones), so each real wheel's detected version is checked.
"""
import json

import torch

from npu_fsdp_patches.plan.decide import public_version
from tests.support import VERIFIED_TORCH as VERIFIED, run_python

_WARNINGS = """
import json
from npu_fsdp_patches.cli.doctor import collect
report = collect()
print(json.dumps([report["frameworks"]["torch"]["version"], report["warnings"]]))
"""


def doctor_torch_and_warnings(paths=()):
    proc = run_python(_WARNINGS, paths=paths)
    return json.loads(proc.stdout.splitlines()[-1])


def test_the_installed_torch_is_verified_and_doctor_is_quiet_about_it():
    assert public_version(torch.__version__) in VERIFIED, (
        f"torch {torch.__version__} is not in the verified list {VERIFIED}: run the suite on a verified torch")
    version, warnings = doctor_torch_and_warnings()
    # the registry's CUDA wheels carry no local label in their metadata (2.6.0), torch.__version__ does
    assert public_version(version) == public_version(torch.__version__)
    assert not [w for w in warnings if w.startswith(f"torch {version}")], warnings


def test_doctor_warns_when_the_torch_metadata_says_an_unverified_version(tmp_path):
    info = tmp_path / "torch-2.9.0.dist-info"   # first on sys.path: metadata says 2.9.0 (2.9.1 is verified)
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.9.0\n")
    version, warnings = doctor_torch_and_warnings(paths=[tmp_path])
    assert version == "2.9.0"
    assert ("torch 2.9.0 is not a verified torch version (the suite runs on torch "
            + ", ".join(VERIFIED) + ")") in warnings
