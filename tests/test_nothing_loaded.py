"""'Nothing loaded' claims, checked on the real targets: with the kill switch or DISABLE=*, every target
of every shipped patch is the framework's own code and training is bitwise what it is with no plugin.

The TENPU and hyper-parallel stand-ins are on the path, so without the switches all patches would be
enabled; the positive control shows the same check does see patched targets then.
"""
import json

import pytest

from npu_fsdp_patches.matrix import load_matrix
from tests.support import REPO_ROOT, install_fixture, run_python
from tests.te_real import require_tenpu_site

pytest.importorskip("torch")

CHILD = """
import hashlib, importlib, json, os, sys
import torch
import transformer_engine.pytorch.optimizers.fused_adam as te_fused_adam
import hyper_parallel.trainer.base, hyper_parallel.core.dtensor.dtensor  # every target module imported
TARGETS, PLUGIN_DIRS = __TARGETS__, tuple(__PLUGIN_DIRS__)

def resolve(symbol):   # no plugin import here: the baseline run must never load it
    module, qualname = symbol.split(":")
    owner = importlib.import_module(module)
    *path, attr = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    for klass in getattr(owner, "__mro__", ()):
        if attr in vars(klass):
            return vars(klass)[attr]
    return getattr(owner, attr)

ours = []
for symbol in TARGETS:
    try:
        obj = resolve(symbol)
    except (ImportError, AttributeError):
        continue
    for _ in range(8):   # follow functools.wraps chains (torch's step hook)
        code = getattr(getattr(obj, "__func__", obj), "__code__", None)
        if code is not None and code.co_filename.startswith(PLUGIN_DIRS):
            ours.append(symbol)
            break
        obj = getattr(obj, "__wrapped__", None)
        if obj is None:
            break

torch.manual_seed(0)
digest = hashlib.sha256()
for make in (lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
             lambda ps: te_fused_adam.FusedAdam(ps, lr=1e-2, weight_decay=0.01)):
    model = torch.nn.Linear(16, 8)
    opt = make(model.parameters())
    for step in range(3):
        model(torch.randn(4, 16)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())
print("RESULT " + json.dumps({"ours": ours, "digest": digest.hexdigest(),
                              "plugin_loaded_by_torch": "npu_fsdp_patches" in sys.modules}))
"""


TARGETS = [t.symbol for spec in load_matrix().patches.values() for t in spec.targets]
PLUGIN_DIRS = [str(REPO_ROOT / "npu_fsdp_patches") + "/", str(REPO_ROOT / "patches") + "/"]


def _run(sites, env):
    code = CHILD.replace("__TARGETS__", repr(TARGETS)).replace("__PLUGIN_DIRS__", repr(PLUGIN_DIRS))
    proc = run_python(code, paths=sites, env=env, timeout=240)
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("RESULT ")][-1][7:])


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
