"""'Nothing loaded' claims, checked on the real targets: with the kill switch or DISABLE=*, every target
of every shipped patch is the framework's own code and training is bitwise what it is with no plugin.

The TENPU and hyper-parallel stand-ins are on the path, so without the switches all patches would be
enabled; the positive control shows the same check does see patched targets then. Child code:
tests/children/nothing_loaded.py.
"""
import pytest

from npu_fsdp_patches.plan.matrix import load_matrix
from tests.support import REPO_ROOT, install_fixture, run_case
from tests.te_real import require_tenpu_site

pytest.importorskip("torch")

TARGETS = [t.symbol for spec in load_matrix().patches.values() for t in spec.targets]
PLUGIN_DIRS = [str(REPO_ROOT / "npu_fsdp_patches") + "/", str(REPO_ROOT / "patches") + "/"]


def _run(sites, env):
    return run_case("tests.children.nothing_loaded:scan", paths=sites, env=env, timeout=240,
                    args={"targets": TARGETS, "plugin_dirs": PLUGIN_DIRS})


@pytest.fixture(scope="module")
def sites(tmp_path_factory):
    root = tmp_path_factory.mktemp("stand_ins")
    return [require_tenpu_site(), install_fixture("hyper_parallel_new", root)]


@pytest.fixture(scope="module")
def without_plugin(sites):
    return _run(sites, {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})


@pytest.mark.parametrize("env", [{"NPU_FSDP_PATCHES": "0"}, {"NPU_FSDP_PATCHES_DISABLE": "*"}])
def test_switched_off_plugin_leaves_targets_and_training_untouched(sites, without_plugin, env):
    result = _run(sites, env)
    assert result["plugin_loaded_by_torch"] is True      # torch autoloaded it; it did nothing
    assert result["ours"] == []
    assert result["digest"] == without_plugin["digest"]


def test_positive_control_the_check_sees_patched_targets(sites, without_plugin):
    result = _run(sites, {})
    assert "torch.optim.adam:adam" in result["ours"]
    assert "transformer_engine.pytorch.optimizers.fused_adam:FusedAdam.step" in result["ours"]
    assert "hyper_parallel.trainer.base:BaseTrainer._build_optimizer" in result["ours"]
    assert without_plugin["ours"] == [] and without_plugin["plugin_loaded_by_torch"] is False
