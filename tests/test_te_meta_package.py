"""The registry's real transformer-engine wheel without transformer-engine-torch is never reported as
a working TE: detection calls it the meta package, doctor says it is installed but not importable
(with TE's own error), and ``doctor --import`` fails every patch whose target it cannot import.

The wheel is TE 2.13.0's (pure Python, `pip download --no-deps` into tests/te_real.py's cache),
installed with `pip install --no-deps --target`, as a user's `pip install transformer-engine` lays it
out; then next to the project's CPU stand-in of the torch extension (tests/fixtures/te_torch_cpu),
where TE still refuses to import (no transformer-engine-cu12 core library).
"""
import json
import subprocess
import sys

import pytest

from tests.te_real import FIXTURES, require_wheel

VERSION = "2.13.0"
EMPTY = "Found empty `transformer-engine` meta package installed"


@pytest.fixture(scope="module")
def meta_site(tmp_path_factory):
    whl = require_wheel(VERSION)
    site = tmp_path_factory.mktemp("te-meta")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile",
                    "--disable-pip-version-check", "--target", str(site), str(whl)],
                   check=True, capture_output=True, timeout=300)
    assert (site / "transformer_engine" / "pytorch" / "optimizers" / "fused_adam.py").is_file()
    return site


def doctor(paths, *args):
    proc = subprocess.run([sys.executable, "-m", "npu_fsdp_patches", "doctor", "--json", *args],
                          capture_output=True, text=True, timeout=300,
                          env=_env(paths))
    return json.loads(proc.stdout), proc.returncode


def _env(paths):
    import os
    env = {k: v for k, v in os.environ.items() if not k.startswith("NPU_FSDP_PATCHES")}
    env["PYTHONPATH"] = os.pathsep.join(map(str, paths))
    return env


def test_the_registry_wheel_alone_is_the_meta_package_and_doctor_says_it_cannot_be_imported(meta_site):
    report, code = doctor([meta_site])
    te = report["frameworks"]["transformer_engine"]
    assert (te["installed"], te["version"], te["source"]) == (False, VERSION, "meta package only")
    assert te["importable"] is False and EMPTY in te["import_error"]
    assert any(e.startswith("transformer_engine: transformer_engine 2.13.0 is installed but not importable")
               and EMPTY in e for e in report["errors"]), report["errors"]
    te_patches = [r for r in report["patches"] if r["name"].startswith("te_")]
    assert {(r["decision"], r["state"]) for r in te_patches} == {("disabled", "disabled")}
    assert all("only the meta package" in r["reason"] for r in te_patches), te_patches
    assert (code, report["exit_code"]) == (1, 1)


def test_next_to_the_extension_stand_in_doctor_import_fails_each_patch_with_te_s_error(meta_site):
    paths = [meta_site, FIXTURES / "te_torch_cpu"]
    report, code = doctor(paths)
    te = report["frameworks"]["transformer_engine"]
    assert (te["installed"], te["flavor"], te["importable"]) == (True, "nvidia", False)
    assert EMPTY in te["import_error"] and (code, report["exit_code"]) == (1, 1)
    report, code = doctor(paths, "--import")
    enabled = {r["name"]: r for r in report["patches"] if r["decision"] == "enabled"}
    assert {"te_fused_adam_dtensor", "te_multi_tensor_apply_empty_tail"} <= set(enabled)
    for record in enabled.values():
        assert record["state"] == "failed" and EMPTY in record["error"], record
        assert record["error"].startswith("target not importable: import transformer_engine.pytorch.")
    assert not any(EMPTY in w for w in report["warnings"]), "the error is the patches', not a warning"
    assert (code, report["exit_code"]) == (1, 1)


def test_the_megatron_te_template_says_it_is_device_only_where_te_cannot_be_imported(meta_site):
    from tests.support import REPO_ROOT
    for paths, why in (([meta_site], EMPTY), ([], "No module named 'transformer_engine'")):   # meta package; none
        proc = subprocess.run([sys.executable, str(REPO_ROOT / "examples" / "megatron_te_fused_adam.py"),
                               "--device", "cpu"], capture_output=True, text=True, timeout=300,
                              env=_env([*paths, REPO_ROOT / "examples"]))
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert "needs a TransformerEngine that imports" in proc.stderr and "device-only" in proc.stderr
        assert why in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
