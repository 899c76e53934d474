"""Activation where the process changes under it: a framework put on sys.path after activation,
MindSpeed's placeholder modules, os.chdir before a spawned worker, the plugin imported from a zip.
Each runs in a fresh interpreter (activation order matters)."""
import shutil
import zipfile

import pytest

from tests.core_demo import late_demo_site
from tests.support import REPO_ROOT, install_fixture, run_case


@pytest.mark.parametrize("autoload", [False, True])
def test_a_framework_put_on_sys_path_after_activation_is_detected_and_patched(tmp_path, autoload):
    site, late = late_demo_site(tmp_path)
    out = run_case("tests.children.activation_cases:framework_added_after_activation",
                   args={"late_site": str(late), "autoload": autoload}, paths=[site],
                   env={"NPU_FSDP_PATCHES_MATRIX": str(site / "demo_matrix.yaml")})
    assert out["autoloaded"] is True
    assert (out["before"]["state"], out["before"]["reason"]) == ("disabled", "demo not installed")
    after = out["after"]
    assert (after["state"], out["greet"]) == ("applied", "hello x!")
    assert after["reason"] == "demo-framework 1.2.0 matches >=1.0"
    assert after["note"] == "decided again after activation: demo found when demo_target was imported"
    assert out["demo"]["version"] == "1.2.0" and "found after activation" in out["demo"]["note"]
    (late_detection,) = out["late"]
    assert (late_detection["framework"], late_detection["module"]) == ("demo", "demo_target")
    assert (late_detection["before"]["installed"], late_detection["after"]["installed"]) == (False, True)
    assert late_detection["enabled"] == ["demo_shout", "demo_child"]


@pytest.mark.parametrize("order", ["before", "after"])
def test_mindspeed_placeholder_modules_read_as_not_installed_and_fire_no_hook(order):
    out = run_case("tests.children.activation_cases:placeholder_frameworks", args={"order": order},
                   env={"NPU_FSDP_PATCHES_ENABLE": "te_fused_adam_dtensor"})
    assert (out["te"]["installed"], out["te"]["source"]) == (False, "not found")
    assert (out["state"], out["applied"], out["step_is_dummy"]) == ("pending", [], True)
    assert "transformer_engine.pytorch.optimizers.fused_adam" in out["waiting_for"]
    assert out["walk_imported"] == []


def test_a_relative_matrix_path_reaches_a_worker_spawned_after_chdir(tmp_path):
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    shutil.copy(REPO_ROOT / "compat_matrix.yaml", work / "my_matrix.yaml")
    out = run_case("tests.children.activation_cases:relative_matrix_spawned",
                   args={"workdir": str(work), "elsewhere": str(elsewhere)},
                   env={"NPU_FSDP_PATCHES_MATRIX": "my_matrix.yaml"})
    for side in ("parent", "worker"):
        assert out[side]["error"] is None, (side, out[side]["error"])
        assert out[side]["matrix"] == str(work / "my_matrix.yaml")
        assert "te_fused_adam_dtensor" in out[side]["patches"]
    assert out["worker"]["cwd"] == str(elsewhere)


def _plugin_zip(path):
    """The plugin laid out as its wheel lays it out (patches/ inside the package), zipped."""
    with zipfile.ZipFile(path, "w") as archive:
        for folder, prefix in ((REPO_ROOT / "npu_fsdp_patches", "npu_fsdp_patches"),
                               (REPO_ROOT / "patches", "npu_fsdp_patches/patches")):
            for file in sorted(folder.rglob("*")):
                if file.is_file() and "__pycache__" not in file.parts:
                    archive.write(file.resolve(), f"{prefix}/{file.relative_to(folder).as_posix()}")
        archive.write(REPO_ROOT / "npu_fsdp_patches_autoload.py", "npu_fsdp_patches_autoload.py")
    return path


def test_the_plugin_imported_from_a_zip_reads_its_shipped_matrix(tmp_path):
    archive = _plugin_zip(tmp_path / "npu_fsdp_patches.zip")
    out = run_case("tests.children.activation_cases:plugin_from_zip", paths=[archive],
                   args={"checkout": str(REPO_ROOT)})
    assert out["file"].startswith(str(archive))
    assert out["error"] is None
    assert set(out["patches"]) >= {"te_fused_adam_dtensor", "hp_fp32_main_params"}


def test_configuration_warnings_at_activation_and_standard_log_level_names():
    from tests.support import run_python
    code = ("import npu_fsdp_patches; from npu_fsdp_patches.runtime import RUNTIME; "
            "print(RUNTIME.snapshot().config_error, len(npu_fsdp_patches.status()))")
    proc = run_python(code, env={"NPU_FSDP_PATCHES_LOG": "error", "NPU_FSDP_PATCHES_DISABLED": "x",
                                 "NPU_FSDP_PATCHES_DISABLE": "te_fused_adam_dtensr"})
    error, count = proc.stdout.split()
    assert error == "None" and int(count) > 0
    assert "WARNING" not in proc.stderr            # the level asked for: error
    proc = run_python(code, env={"NPU_FSDP_PATCHES_LOG": "WARNING", "NPU_FSDP_PATCHES_DISABLED": "x",
                                 "NPU_FSDP_PATCHES_DISABLE": "te_fused_adam_dtensr"})
    assert ("NPU_FSDP_PATCHES_DISABLED is not a variable of npu_fsdp_patches and is ignored; did you mean "
            "NPU_FSDP_PATCHES_DISABLE?") in proc.stderr
    assert "te_fused_adam_dtensr (did you mean te_fused_adam_dtensor?)" in proc.stderr
