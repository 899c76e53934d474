"""te_initialize_state_compat on megatron-core 0.19.x (Python >= 3.12) against TE's real fused_adam.py.

megatron-core 0.17-0.19 need Python 3.12, so these run in the venv .ci/steps/50-megatron-py312.sh
builds; elsewhere they skip, unless NPU_FSDP_PATCHES_REQUIRE_MEGATRON_PY312=1 (that CI step) makes a
missing environment a failure. TE's real optimizer source comes from the registry wheel through
``tests/te_real.py`` (``require_te_site``, CPU kernels). Rank code: tests/multirank/megatron_py312_cases.py.
"""
import os
import sys

import pytest

from tests.distributed import run_ranks

MEGATRON_MIN = (0, 17)
TE_VERSION = "2.20.2"      # the newest TE release; initialize_state(param, store_param_remainders)


def _require_environment() -> str:
    """The real-TE site path, or skip (fail under NPU_FSDP_PATCHES_REQUIRE_MEGATRON_PY312=1)."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        found = version("megatron-core")
    except PackageNotFoundError:
        found = None
    ok = found is not None and tuple(int(x) for x in found.split(".")[:2]) >= MEGATRON_MIN
    reason = (f"needs megatron-core >= 0.17 on Python >= 3.12 (found {found} on "
              f"{sys.version_info[0]}.{sys.version_info[1]}); run .ci/steps/50-megatron-py312.sh")
    if not ok:
        if os.environ.get("NPU_FSDP_PATCHES_REQUIRE_MEGATRON_PY312") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    from tests.te_real import require_te_site
    return str(require_te_site(TE_VERSION))


def _run(case, site, env=None):
    env = {"PYTHONPATH": site, **(env or {})}
    return run_ranks(f"tests.multirank.megatron_py312_cases:{case}", world_size=2,
                     args={"te_site": site}, env=env, timeout=600)


def test_megatron_init_state_fn_on_real_te_fails_without_the_patch():
    site = _require_environment()
    for result in _run("factory_init_state_fn", site, {"NPU_FSDP_PATCHES_DISABLE": "te_initialize_state_compat"}):
        assert result["patch"] == "disabled"
        assert "store_param_remainders" in result["error"]


def test_megatron_init_state_fn_on_real_te_with_the_patch():
    site = _require_environment()
    for result in _run("factory_init_state_fn", site):
        assert result["patch"] == "applied" and result["python"] >= (3, 12)
        assert tuple(int(x) for x in result["megatron"].split(".")[:2]) >= MEGATRON_MIN
        assert result["master_weights"] and result["store_param_remainders"]
        states = result["states"]
        assert states["0.weight"] == {"exp_avg": "torch.float32", "exp_avg_sq": "torch.float32",
                                      "master_param": "torch.float32"}
        assert states["1.weight"]["master_param"] == "torch.int16"    # bf16 + fp32 master: remainders


def test_megatron_fsdp_dtensor_main_weights_with_decoupled_grad():
    site = _require_environment()
    results = _run("fsdp_dtensor_main_weights", site)
    for result in results:
        assert result["patch"] == "applied" and "error" not in result, result.get("error")
        assert result["built"] == {"master_weights": True, "use_decoupled_grad": True}
        for layout in result["state_layout"].values():   # fp32 DTensor main weights: no master copy
            assert set(layout) == {"exp_avg", "exp_avg_sq"}
            assert all(kind == "DTensor" and dtype == "torch.float32" for kind, _, _, dtype in layout.values())
        assert result["max_diff"] < 1e-6
    assert [r["local_rows"] for r in results] == [[4, 3, 1], [3, 2, 0]]


def test_megatron_fsdp_dtensor_case_fails_without_the_patch():
    site = _require_environment()
    for result in _run("fsdp_dtensor_main_weights", site, {"NPU_FSDP_PATCHES_DISABLE": "te_initialize_state_compat"}):
        assert "store_param_remainders" in result["error"]


def test_megatron_fsdp_own_buffers_on_cpu_with_real_te():
    """Megatron-FSDP's own classes (megatron-core 0.19.2) on gloo/CPU: what blocks them, and with the one
    blocker of ParamAndGradBuffer bypassed, its DTensor main weights through TE's real FusedAdam."""
    site = _require_environment()
    results = _run("megatron_fsdp_on_cpu", site)
    for r in results:
        # MegatronFSDP.__init__ compares its device with torch.cuda.current_device() unconditionally
        assert r["MegatronFSDP"]["where"].endswith("megatron_fsdp/megatron_fsdp.py:234"), r["MegatronFSDP"]
        # make_fsdp_dtensor(run_check=True) -> validate_uneven_dtensor: torch.tensor(...).cuda()
        assert r["ParamAndGradBuffer"]["where"].endswith("megatron_fsdp/uneven_dtensor.py:187"), r
        seam = r["ParamAndGradBuffer, .cuda() a no-op"]
        assert seam.get("built"), seam
        assert all(kind == "DTensor" for _, kind, _ in seam["params"])
        assert seam["max_err"] < 1e-6 and seam["none_grads_on_empty"], seam
        assert seam["states"] == ["exp_avg", "exp_avg_sq"]          # master_weights flipped off
        assert seam["patch_states"]["te_fused_adam_empty_scale"] == "applied"
    numels = [r["ParamAndGradBuffer, .cuda() a no-op"]["local_numels"] for r in results]
    assert 0 in sum(numels, []) and len({tuple(n) for n in numels}) > 1, numels   # uneven, empty shards


def test_megatron_0_19_distributed_optimizer_groups_resume_with_the_empty_group_step_patch(tmp_path):
    """te_fused_adam_empty_group_step with megatron-core 0.19's own param groups, distributed-optimizer
    layout (``DistributedOptimizer._compute_per_buffer_param_layout``) and factory, on TE 2.18.0, the last
    release before the fix (tests/test_megatron_empty_group_step.py runs 0.16.1)."""
    _require_environment()
    from tests.te_real import require_te_site
    from tests.test_megatron_empty_group_step import assert_megatron_resume, run_megatron_resume
    results = run_megatron_resume(require_te_site("2.18.0"), tmp_path)
    assert all(r["factory_stop"] is None for r in results), [r["factory_stop"] for r in results]
    assert_megatron_resume(results, "0.19.")
