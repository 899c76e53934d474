"""te_fused_adam_dtensor and te_initialize_state_compat on TE fixtures, in fresh interpreters."""
import os
import shutil

import pytest

from tests.distributed import run_ranks
from tests.multirank import te_fused_adam_cases
from tests.support import assert_check, run_python
from tests.te_real import require_te_site, require_tenpu_site

FLAVORS = ("tenpu", "nvte211")
_ENV = {"TORCH_DEVICE_BACKEND_AUTOLOAD": os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1")}


def _site(flavor, tmp_path):
    """TENPU's stand-in (NVTE 2.15's real FusedAdam under TENPU's overlay), or TE 2.11's real one."""
    return require_tenpu_site() if flavor == "tenpu" else require_te_site("2.11.0")


UNPATCHED_ERRORS = {
    "tenpu": "NotImplementedError: FusedAdam on NPU does not support DTensor",
    # real 2.10/2.11 train fp32 DTensors silently with global-shape plain states:
    # no error here; tests/test_te_real.py shows the wrong result and the master-weight crash
    "nvte211": None,
}


@pytest.fixture(scope="module", params=FLAVORS)
def dtensor_training(request, tmp_path_factory):
    """One 2-rank launch of tests/multirank/te_fused_adam_cases.py per flavor."""
    site = _site(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, run_ranks("tests.multirank.te_fused_adam_cases:te_patch_cases", 2,
                                    timeout=240, env={**_ENV, "PYTHONPATH": str(site)})


@pytest.mark.parametrize("check", te_fused_adam_cases.CHECKS)
def test_dtensor_training_on_the_patched_te_class(dtensor_training, check):
    assert_check(dtensor_training[1], check, te_fused_adam_cases.CHECKS)


def test_dtensor_training_applies_the_patch_and_the_unpatched_class_fails_as_known(dtensor_training):
    flavor, results = dtensor_training
    unpatched_error = UNPATCHED_ERRORS[flavor]
    for r in results:
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


_TENPU_DERIVED = """
import inspect, torch
from transformer_engine.pytorch.optimizers import FusedAdam
from transformer_engine.pytorch.optimizers import _nvte_fused_adam as nvte
assert FusedAdam.__mro__[1] is nvte.FusedAdam
args = lambda f: [(a.name, a.kind, a.default) for a in inspect.signature(f).parameters.values()]
assert args(FusedAdam.__init__) == args(nvte.FusedAdam.__init__)  # RFC 3.5.2.1: NVTE's constructor
for name in ("set_scaled_state", "state_dict", "load_state_dict", "zero_grad"):
    assert name not in vars(FusedAdam), name  # NVTE's own code
# the overlay: RFC 3.3.10 (signatures), 3.3.1 (unsupported options), 3.3.5 (fp16 scale), 3.3.6 (kernel)
assert str(inspect.signature(FusedAdam.initialize_state)) == "(self, param, store_param_remainders=None) -> None"
assert str(inspect.signature(nvte.FusedAdam.initialize_state)) == "(self, param, store_param_remainders)"
assert "skip_unscale" in str(inspect.signature(nvte.FusedAdam.get_unscaled_state))
assert "skip_unscale" not in str(inspect.signature(FusedAdam.get_unscaled_state))
for kw in ({"capturable": True}, {"bias_correction": False}, {"amsgrad": True}):
    try:
        FusedAdam([torch.nn.Parameter(torch.ones(2))], **kw)
    except RuntimeError:
        pass
    else:
        raise AssertionError(kw)
p = torch.nn.Parameter(torch.zeros(3))
opt = FusedAdam([p], exp_avg_dtype=torch.float16)
opt.initialize_state(p)
opt.set_scaled_state(p, "exp_avg", torch.zeros(3))
assert opt._scales[p]["exp_avg"].item() == 1.0  # a zero absmax keeps the unit scale
opt.set_scaled_state(p, "exp_avg", torch.tensor([1e-3, -2.0, 0.5]))
assert torch.equal(opt._scales[p]["exp_avg"], torch.tensor([2.0]) / (torch.finfo(torch.float16).max / 2))
e = torch.nn.Parameter(torch.zeros(0))
e.grad = torch.zeros(0)
try:
    FusedAdam([e], exp_avg_dtype=torch.float16).step()
except RuntimeError:
    pass  # abs().max() of an empty state (RFC 1.2), what TENPU's fix adds a branch for
else:
    raise AssertionError("empty fp16 state scaled")
gen = torch.Generator().manual_seed(0)
a = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (33, 5)]
b = [torch.nn.Parameter(x.detach().clone()) for x in a]
ta = FusedAdam(a, lr=1e-2, weight_decay=0.1)
tb = torch.optim.AdamW(b, lr=1e-2, weight_decay=0.1, fused=True)
for _ in range(4):
    for x, y in zip(a, b):
        x.grad = torch.randn(x.shape, generator=gen)
        y.grad = x.grad.clone()
    ta.step()
    tb.step()
for x, y in zip(a, b):  # the direct path is torch's fused AdamW kernel, bit for bit
    assert torch.equal(x, y)
    assert not torch.equal(x, torch.nextafter(y, torch.full_like(y, 1e9))), "1-ulp control"
print("OK")
"""


def test_tenpu_stand_in_is_nvte_2_15_under_the_documented_overlay():
    """The TENPU stand-in is NVTE 2.15.0's real class, and the overlay changes only what RFC #43
    documents (without the plugin, so every method is the stand-in's own)."""
    site = require_tenpu_site()
    env = {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "NPU_FSDP_PATCHES": "0"}
    assert "OK" in run_python(_TENPU_DERIVED, paths=[site], env=env).stdout


_STATUS = """
import json, npu_fsdp_patches
import transformer_engine.pytorch.optimizers as o
print(json.dumps({r["name"]: [r["state"], r["note"]] for r in npu_fsdp_patches.status()}))
"""


def test_stands_down_when_the_installed_class_handles_dtensor(tmp_path):
    site = tmp_path / "tenpu"  # a copy: the text of its fused_adam.py is edited below
    shutil.copytree(require_tenpu_site(), site)
    path = site / "transformer_engine/pytorch/optimizers/fused_adam.py"
    src = path.read_text()
    out = run_python(_STATUS, paths=[site], env=_ENV).stdout
    assert '"te_fused_adam_dtensor": ["applied"' in out  # control: the pre-fix class
    # the fix itself (docs/te_fused_adam.md#5-gates): states re-wrapped with the param's layout;
    # skip_unscale alone (one release earlier) is not the fix
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
