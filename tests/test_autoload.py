"""The torch.backends entry point: torch >= 2.5 loads the plugin on `import torch`, and it never raises."""
import pytest

from tests.core_demo import run_demo

pytest.importorskip("torch")


def test_import_torch_autoloads_the_plugin_and_patches_targets(tmp_path):
    result, _ = run_demo(tmp_path, """
import demo_target
import torch
emit(loaded="npu_fsdp_patches" in sys.modules, greet=demo_target.greet("x"))
""")
    assert result == {"loaded": True, "greet": "hello x!"}


def test_torch_autoload_kill_switch_is_respected(tmp_path):
    result, _ = run_demo(tmp_path, """
import torch
emit(loaded="npu_fsdp_patches" in sys.modules)
""", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert result == {"loaded": False}


def test_autoload_never_breaks_import_torch_even_when_strict(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("schema_version: [\n")
    result, proc = run_demo(tmp_path, """
import torch
emit(torch=torch.__version__.split("+")[0] != "", plugin_loaded="npu_fsdp_patches" in sys.modules)
""", NPU_FSDP_PATCHES_MATRIX=str(bad), NPU_FSDP_PATCHES_STRICT="1")
    assert result == {"torch": True, "plugin_loaded": False}
    assert "npu_fsdp_patches could not activate during torch autoload" in proc.stderr


def test_autoload_with_strict_failing_patch_keeps_torch_importable(tmp_path):
    result, _ = run_demo(tmp_path, """
import demo_target
import torch
emit(ok=True)
""", matrix="demo_matrix_failing.yaml", NPU_FSDP_PATCHES_STRICT="1")
    assert result == {"ok": True}
