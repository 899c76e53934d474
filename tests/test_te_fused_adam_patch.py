"""te_fused_adam_dtensor and te_initialize_state_compat on TE fixtures, in fresh interpreters.

One 2-rank launch per flavor (tests/multirank/te_fused_adam_cases.py) checks DTensor training, plain-tensor
training and, on NVTE 2.11, the one-argument ``initialize_state``; each check is its own test below.
"""
import os
import shutil

import pytest

from tests.distributed import launch_once, run_ranks
from tests.multirank import te_fused_adam_cases
from tests.support import assert_check, run_python
from tests.te_real import require_te_site, require_tenpu_site

FLAVORS = ("tenpu", "nvte211")
_ENV = {"TORCH_DEVICE_BACKEND_AUTOLOAD": os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1")}


def _site(flavor):
    """TENPU's stand-in (NVTE 2.15's real FusedAdam under TENPU's overlay), or TE 2.11's real one."""
    return require_tenpu_site() if flavor == "tenpu" else require_te_site("2.11.0")


UNPATCHED_ERRORS = {
    "tenpu": "NotImplementedError: FusedAdam on NPU does not support DTensor",
    # real 2.10/2.11 train fp32 DTensors silently with global-shape plain states:
    # no error here; tests/test_te_real.py shows the wrong result and the master-weight crash
    "nvte211": None,
}


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """``launch(flavor)``: that flavor's one 2-rank launch of tests/multirank/te_fused_adam_cases.py,
    run once for every test of it (a failed launch fails each of them with its report). On TENPU it also
    runs te_fused_adam_empty_group_step's cases (tests/multirank/te_step_counter_cases.py)."""
    def run(flavor):
        args = {"flavor": flavor}
        if flavor == "tenpu":
            args["fixes_dir"] = str(tmp_path_factory.mktemp("tenpu-counter"))
        return run_ranks("tests.multirank.te_fused_adam_cases:te_patch_cases", 2, args=args, timeout=300,
                         env={**_ENV, "PYTHONPATH": str(_site(flavor))})
    return launch_once(run)


@pytest.fixture(scope="module", params=FLAVORS)
def dtensor_training(request, launch):
    return request.param, launch(request.param)


@pytest.mark.parametrize("check", te_fused_adam_cases.CHECKS)
def test_dtensor_training_on_the_patched_te_class(dtensor_training, check):
    flavor, results = dtensor_training
    assert_check(results, check, te_fused_adam_cases.DECLARED[flavor])


def test_dtensor_training_applies_the_patch_and_the_unpatched_class_fails_as_known(dtensor_training):
    flavor, results = dtensor_training
    unpatched_error = UNPATCHED_ERRORS[flavor]
    for r in results:
        assert r["facts"]["state"] == "applied"
        if unpatched_error is None:
            assert r["facts"]["unpatched_error"] is None
        else:
            assert unpatched_error in (r["facts"]["unpatched_error"] or "")


def test_plain_tensor_training_is_bitwise_the_original(dtensor_training):
    """Reverted vs applied on plain tensors, four configs, with a 1-ulp control (in the same launch)."""
    flavor, results = dtensor_training
    assert_check(results, te_fused_adam_cases.PLAIN_CHECK, te_fused_adam_cases.DECLARED[flavor])


_TENPU_DERIVED = """
import inspect, torch
from transformer_engine.pytorch.optimizers import FusedAdam
from transformer_engine.pytorch.optimizers import _nvte_fused_adam as nvte
assert FusedAdam.__mro__[1] is nvte.FusedAdam
args = lambda f: [(a.name, a.kind, a.default) for a in inspect.signature(f).parameters.values()]
assert args(FusedAdam.__init__) == args(nvte.FusedAdam.__init__)  # TENPU RFC #43 3.5.2.1: NVTE's constructor
for name in ("set_scaled_state", "state_dict", "load_state_dict", "zero_grad"):
    assert name not in vars(FusedAdam), name  # NVTE's own code
# the overlay, TENPU RFC #43 (docs/te_fused_adam.md#3-tenpu-rfc-43): 3.3.10 (signatures),
# 3.3.1 (unsupported options), 3.3.5 (fp16 scale), 3.3.6 (kernel)
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
    pass  # abs().max() of an empty state (TENPU RFC #43 1.2), what TENPU's fix adds a branch for
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


def test_initialize_state_one_argument_on_nvte_2_11(launch):
    """Without te_initialize_state_compat NVTE 2.11's one-argument call fails; with it the value is
    derived and a contradicting one refused (in the nvte211 launch above)."""
    assert_check(launch("nvte211"), te_fused_adam_cases.INIT_STATE_CHECK,
                 te_fused_adam_cases.DECLARED["nvte211"])


def test_tenpu_empty_group_counters_resume_like_a_one_rank_run(launch):
    """te_fused_adam_empty_group_step on the TENPU stand-in, whose step skips empty groups as NVTE's does:
    Megatron's distributed-optimizer shards resumed at 2, 3 and 1 ranks (tests/test_te_real.py's case), a
    DTensor optimizer with an empty group, and the negative control on TENPU's own code."""
    results = launch("tenpu")
    for rank, r in enumerate(results):
        counter = r["counter"]
        assert counter["status"]["te_fused_adam_empty_group_step"] == "applied", counter["status"]
        assert counter["patched"]["dtensor"]["counters"] == [2, 2], (rank, counter["patched"]["dtensor"])
        assert counter["patched"]["reverted_hooks"]["counters"] == [[1, 1], [2, 1], [3, 2]]
    got = {k: v for r in results for k, v in r["counter"]["patched"]["resume"]["resumed"].items()}
    assert len(got) == 7 and all(v["after_load"] == [3, 3] and v["after_step"] == [4, 4] and v["matches_reference"]
                                 for v in got.values()), got
    own = {k: v for r in results for k, v in r["counter"]["unpatched"]["resume"]["resumed"].items()}
    assert own["2:1"]["after_load"] == [3, None] and not own["1:from1"]["matches_reference"], own
