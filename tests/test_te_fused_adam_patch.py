"""te_fused_adam_dtensor and te_initialize_state_compat on TE fixtures, in fresh interpreters."""
import os

import pytest

from tests.distributed import run_ranks
from tests.support import install_fixture, run_python
from tests.te_real import require_te_site

FLAVORS = ("tenpu", "nvte211")
_ENV = {"TORCH_DEVICE_BACKEND_AUTOLOAD": os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1")}


def _site(flavor, tmp_path):
    """TENPU's stand-in fixture, or TE 2.11's real FusedAdam from its registry wheel."""
    return install_fixture("te_npu_prefix", tmp_path) if flavor == "tenpu" else require_te_site(
        "2.11.0")


@pytest.mark.parametrize("flavor, unpatched_error", [
    ("tenpu", "NotImplementedError: FusedAdam on NPU does not support DTensor"),
    # real 2.10/2.11 train fp32 DTensors silently with global-shape plain states (#2424):
    # no error here; tests/test_te_real.py shows the wrong result and the master-weight crash
    ("nvte211", None),
])
def test_dtensor_training_on_the_patched_te_class(tmp_path, flavor, unpatched_error):
    site = _site(flavor, tmp_path)
    results = run_ranks("tests.multirank.te_fused_adam_cases:te_patch_cases", 2, timeout=240,
                        env={**_ENV, "PYTHONPATH": str(site)})
    for r in results:
        assert r["failures"] == []
        assert r["facts"]["state"] == "applied"
        if unpatched_error is None:
            assert r["facts"]["unpatched_error"] is None
        else:
            assert unpatched_error in (r["facts"]["unpatched_error"] or "")


_PLAIN_BITWISE = """
import torch, npu_fsdp_patches
from transformer_engine.pytorch.optimizers import FusedAdam
assert getattr(FusedAdam.step, "__npu_fsdp_patch__", None) == "te_fused_adam_dtensor"

def train(**kw):
    gen = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(n, generator=gen).to(dt))
          for n, dt in ((33, torch.float32), (5, torch.float32))]
    opt = FusedAdam(ps, lr=1e-2, weight_decay=0.1, **kw)
    for _ in range(6):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()
    sd = opt.state_dict()
    return [p.detach().clone() for p in ps], sd

for kw in ({}, {"adam_w_mode": False}, {"exp_avg_dtype": torch.float16},
           {"master_weights": True, "exp_avg_sq_dtype": torch.bfloat16}):
    npu_fsdp_patches.revert("te_fused_adam_dtensor")
    assert not hasattr(FusedAdam.step, "__npu_fsdp_patch__")
    ref, ref_sd = train(**kw)
    npu_fsdp_patches.apply("te_fused_adam_dtensor")
    assert FusedAdam.step.__npu_fsdp_patch__ == "te_fused_adam_dtensor"
    got, got_sd = train(**kw)
    for a, b in zip(got, ref):
        assert torch.equal(a, b), kw
        assert not torch.equal(a, torch.nextafter(b, torch.full_like(b, 1e9))), "1-ulp control"
    for k in ref_sd["state"]:
        for name, v in ref_sd["state"][k].items():
            assert torch.equal(got_sd["state"][k][name], v), (kw, name)
print("OK")
"""


@pytest.mark.parametrize("flavor", FLAVORS)
def test_plain_tensor_training_is_bitwise_the_original(tmp_path, flavor):
    site = _site(flavor, tmp_path)
    assert "OK" in run_python(_PLAIN_BITWISE, paths=[site], env=_ENV).stdout


_STATUS = """
import json, npu_fsdp_patches
import transformer_engine.pytorch.optimizers as o
print(json.dumps({r["name"]: [r["state"], r["note"]] for r in npu_fsdp_patches.status()}))
"""


def test_stands_down_when_the_installed_class_handles_dtensor(tmp_path):
    site = install_fixture("te_npu_prefix", tmp_path)
    path = site / "transformer_engine/pytorch/optimizers/fused_adam.py"
    src = path.read_text()
    out = run_python(_STATUS, paths=[site], env=_ENV).stdout
    assert '"te_fused_adam_dtensor": ["applied"' in out  # control: the pre-fix class
    # the fix itself (TENPU 5c85c0d's _wrap_state, NVTE #2795): states re-wrapped with the
    # param's layout; skip_unscale alone (#2632, one release before #2795) is not the fix
    path.write_text(src.replace(
        "def get_unscaled_state(self, param, state_name):",
        "def get_unscaled_state(self, param, state_name, skip_unscale=False):"))
    out = run_python(_STATUS, paths=[site], env=_ENV).stdout
    assert '"te_fused_adam_dtensor": ["applied"' in out
    path.write_text(src + """
    @staticmethod
    def _wrap_state(param, value):
        return DTensor.from_local(value, device_mesh=param.device_mesh, placements=param.placements,
                                  shape=param.shape, stride=param.stride(), run_check=False)
""")
    out = run_python(_STATUS, paths=[site], env=_ENV).stdout
    assert '"te_fused_adam_dtensor": ["skipped", "upstream has it (probe upstream_handles_dtensor)"]' in out
    # the pre-fix TENPU stand-in already defaults initialize_state's second argument
    assert '"te_initialize_state_compat": ["skipped", "upstream has it (probe upstream_has_default)"]' in out


_INIT_STATE = """
import torch, npu_fsdp_patches
from transformer_engine.pytorch.optimizers import FusedAdam
p = torch.nn.Parameter(torch.randn(4).bfloat16())
f = torch.nn.Parameter(torch.randn(4))
npu_fsdp_patches.revert("te_initialize_state_compat")
try:
    FusedAdam([p], master_weights=True).initialize_state(p)
except TypeError as e:
    assert "store_param_remainders" in str(e), e
else:
    raise AssertionError("one-argument call worked without the patch")
npu_fsdp_patches.apply("te_initialize_state_compat")
opt = FusedAdam([p, f], master_weights=True, store_param_remainders=True)
opt.initialize_state(p)
opt.initialize_state(f)
assert opt.state[p]["master_param"].dtype == torch.int16   # derived: bf16 + fp32 master
assert opt.state[f]["master_param"].dtype == torch.float32  # derived: fp32 param
opt.initialize_state(f, False)  # an explicit value that agrees
for param, value in ((p, False), (f, True)):
    try:
        FusedAdam([param], master_weights=True, store_param_remainders=True).initialize_state(
            param, value)
    except ValueError as e:
        assert "contradicts" in str(e), e
    else:
        raise AssertionError("contradicting value accepted")
print("OK")
"""


def test_initialize_state_one_argument_on_nvte_2_11(tmp_path):
    site = require_te_site("2.11.0")
    assert "OK" in run_python(_INIT_STATE, paths=[site], env=_ENV).stdout
