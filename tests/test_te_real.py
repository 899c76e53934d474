"""The TE patches against TE's real FusedAdam source of every verified release (tests/te_real.py).

The same launch also runs te_fused_adam_empty_group_step's Megatron-distributed-optimizer-shaped resume
and the FP8-moment cases of te_fused_adam_empty_scale on TE's own code and patched (the
``test_*counter*`` and ``test_fp8_*`` tests below), on every release, 1.13 (no DTensor configs) included.

Per release, one gloo launch trains every config on TE's own code (the negative control: the known
failure of that release must show) and then with the patches the matrix enables (every config must
match a float64 AdamW reference, keep DTensor states with the param's layout and round-trip its
state_dict). Params have uneven and empty Shard(0) shards, the last one empty on ranks >= 1.

One 2-rank launch per release (tests/multirank/te_real_cases.py ``two_ranks``) also checks plain-tensor
training and, for the DCP releases, saves the checkpoint that their one 3-rank launch (``three_ranks``:
the configs at 3 ranks, then the DCP load) resumes; each launch runs once for every test of it.
"""
import os

import pytest

from tests.distributed import launch_once, run_ranks
from tests.support import run_python
from tests.te_real import require_te_site

CASES = "tests.multirank.te_real_cases"
CONFIGS = ["fp32", "bf16_master", "bf16_moments", "fp16_moments", "decoupled"]
_ENV = {"TORCH_DEVICE_BACKEND_AUTOLOAD": os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1")}
# max |param - float64 AdamW| after 5 steps: fp32 ~2 ulp; bf16 params 1 bf16 ulp; scaled moments
_TOL = {"fp32": 1e-6, "decoupled": 1e-6, "bf16_master": 8e-3, "bf16_moments": 2e-4,
        "fp16_moments": 5e-5}
# which patch must be applied on each release (the rest stand down by gate or probe); 1.13 predates
# DTensor support, so it runs only the step-counter and FP8 cases
_SCALE, _COUNTER = "te_fused_adam_empty_scale", "te_fused_adam_empty_group_step"
APPLIED = {
    "1.13.0": {_SCALE, _COUNTER},
    "2.10.0": {"te_fused_adam_dtensor", "te_multi_tensor_apply_empty_tail", _SCALE, _COUNTER},
    "2.11.0": {"te_fused_adam_dtensor", "te_multi_tensor_apply_empty_tail", _SCALE, _COUNTER},
    "2.12.0": {"te_fused_adam_dtensor", "te_multi_tensor_apply_empty_tail", _SCALE, _COUNTER},
    "2.13.0": {"te_fused_adam_dtensor", "te_multi_tensor_apply_empty_tail", _SCALE, _COUNTER},
    "2.14.0": {"te_multi_tensor_apply_empty_tail", _SCALE, _COUNTER},
    "2.17.1": {"te_multi_tensor_apply_empty_tail", _SCALE, _COUNTER},
    "2.18.0": {_SCALE, _COUNTER},
    "2.20.2": {_SCALE},   # the control past the counter fix (734ce31e, 2.19)
}
DTENSOR_RELEASES = [v for v in APPLIED if v != "1.13.0"]
_TE_PATCHES = {"te_fused_adam_dtensor", "te_multi_tensor_apply_empty_tail", _SCALE, _COUNTER}


THREE_RANKS = ["2.11.0", "2.17.1"]   # also the DCP releases: saved at 2 ranks, loaded at 3


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """``launch(version, world)``: that release's 2- or 3-rank launch, run once (a failed launch fails
    every test of it with its report); the 3-rank one loads the 2-rank one's DCP checkpoint."""
    run = launch_once(lambda version, world: _launch(version, world, run, tmp_path_factory))
    return run


def _launch(version, world, run, tmp_path_factory):
    site = require_te_site(version)
    args = {"configs": CONFIGS if version in DTENSOR_RELEASES else [],
            "fixes_dir": str(tmp_path_factory.mktemp(f"te-fixes-{version}-{world}"))}
    if version in THREE_RANKS:
        if world == 3:
            run(version, 2)   # writes the checkpoint
        d = tmp_path_factory.getbasetemp() / f"te-real-dcp-{version}"
        d.mkdir(exist_ok=True)
        args["dcp_args"] = {"ckpt": str(d / "ckpt"), "ref_path": str(d / "ref.pt")}
    if world == 3:
        del args["fixes_dir"]
    case = {2: "two_ranks", 3: "three_ranks"}[world]
    return run_ranks(f"{CASES}:{case}", world, args=args, timeout=600,
                     env={**_ENV, "PYTHONPATH": str(site)})


def _assert_known_failure(version, world, results):
    """The negative control: TE's own code of ``version`` shows its documented failure."""
    u = [r["unpatched"] for r in results]
    last = world - 1  # holds an empty shard of the last param
    if version in ("2.10.0", "2.11.0"):  # plain global-shape states
        assert "mixed torch.Tensor and DTensor" in u[0]["bf16_master"]["error"]
        assert u[0]["fp32"]["error"] is None and u[0]["fp32"]["layout_ok"] is False
        assert u[0]["fp32"]["max_err"] > 1e-3  # trains silently wrong
    elif version in ("2.12.0", "2.13.0"):  # get_unscaled_state: unscaled.mul_(scale) on a DTensor
        assert any("Sharding propagation failed" in (x["fp16_moments"]["error"] or "") for x in u)
    if version < "2.18":  # the rank never launches its pending batch behind an empty shard
        assert u[last]["fp32"]["updated"][:2] == [False, False], u[last]["fp32"]
    else:
        assert u[last]["fp32"]["updated"] == [True] * 3 and u[0]["fp32"]["max_err"] < 1e-6
    if version >= "2.14":  # _apply_scale: torch.aminmax on the empty local shard
        assert "cannot compute aminmax over an empty dimension" in u[last]["fp16_moments"]["error"]


def _assert_patched(version, results):
    for rank, r in enumerate(results):
        # the DTensor path below 2.14 is torch's _fused_adamw_, TE's own kernel from 2.14 on
        print(f"TE {version} rank {rank}: DTensor vs TE plain-tensor path: "
              f"{r['ulps_vs_te_plain']} fp32 ulp")
        assert r["ulps_vs_te_plain"] <= (4 if version < "2.14" else 0), r["ulps_vs_te_plain"]
        applied = {n for n, s in r["status"].items() if s == "applied"} & _TE_PATCHES
        assert applied == APPLIED[version], (rank, r["status"])
        for config in CONFIGS:
            got = r["patched"][config]
            assert got["error"] is None, (rank, config, got.get("where"))
            assert got["updated"] == [True] * 3 and got["layout_ok"], (rank, config, got)
            assert got["max_err"] < _TOL[config], (rank, config, got["max_err"])
            # TE's own fp16 path re-derives the scale on load (set_scaled_state -> _apply_scale)
            own_fp16 = config == "fp16_moments" and version >= "2.14"
            assert got["round_trip"] or own_fp16, (rank, config)


@pytest.mark.parametrize("version", DTENSOR_RELEASES)
def test_real_te_release_on_two_ranks(launch, version):
    results = [r["configs"] for r in launch(version, 2)]
    _assert_known_failure(version, 2, results)
    _assert_patched(version, results)


@pytest.mark.parametrize("version", THREE_RANKS)
def test_real_te_release_on_three_ranks(launch, version):
    results = [r["configs"] for r in launch(version, 3)]
    _assert_known_failure(version, 3, results)
    _assert_patched(version, results)


@pytest.mark.parametrize("version", list(APPLIED))
def test_plain_tensor_training_is_bitwise_the_real_class(launch, version):
    for rank, r in enumerate(launch(version, 2)):
        for config, out in r["plain"].items():
            assert out["bitwise"] and out["control_caught"], (rank, config, out)


_ONE_ARG = """
import torch, npu_fsdp_patches
from transformer_engine.pytorch.optimizers import FusedAdam
from npu_fsdp_patches.patches.te_initialize_state import TeInitializeStateCompat
import importlib.metadata as md
print("VERSION", md.version("transformer_engine"))
print("PROBE", TeInitializeStateCompat().upstream_has_default())
p = torch.nn.Parameter(torch.randn(4))
opt = FusedAdam([p])
opt.initialize_state(p)
print("STATES", sorted(opt.state[p]))
"""


#: the releases te_initialize_state_compat runs on here (compat_matrix.yaml verified, with 2.20.2 from
#: .ci/steps/50-megatron-py312.sh; tests/test_verified_lists.py); 2.13.0 is the README's stack
INITIALIZE_STATE = {"1.13.0": True, "2.11.0": False, "2.13.0": False}


@pytest.mark.parametrize("version, has_default", list(INITIALIZE_STATE.items()))
def test_initialize_state_probe_on_real_sources(version, has_default):
    site = require_te_site(version)
    env = {**_ENV, "NPU_FSDP_PATCHES_ENABLE": "te_initialize_state_compat"}
    out = run_python(_ONE_ARG, paths=[site], env=env).stdout
    assert f"VERSION {version}" in out
    assert f"PROBE {has_default}" in out  # 1.13 takes one argument: the probe stands down
    assert "STATES ['exp_avg', 'exp_avg_sq']" in out


@pytest.mark.parametrize("version", THREE_RANKS)
def test_dcp_save_at_two_ranks_load_at_three(launch, version):
    saved = [r["dcp"] for r in launch(version, 2)]
    assert [r["local_numels"]["w1"] for r in saved] == [1, 0]
    loaded = [r["dcp"] for r in launch(version, 3)]
    assert sum(r["local_numels"]["w7"] for r in loaded) == 7
    for rank, r in enumerate(loaded):
        assert r["steps_after_load"] == [3], (rank, r)
        for key, err in r["max_err"].items():
            # after resharding, fp16 moments are re-scaled per shard (TE's own 2e-3 tolerance),
            # which moves the next two updates by ~lr * 2e-3; bf16 params: 1 bf16 ulp
            tol = 2e-3 if key.endswith("exp_avg") else (1e-2 if key in ("m73", "r5", "w1") else 1e-4)
            assert err <= tol, (rank, key, err)


# ----------------------------------------------------------------------------- te_fused_adam_empty_group_step

def _fixed_upstream(version) -> bool:
    """734ce31e (PR #3318): TE 2.19 advances every group's counter."""
    return tuple(int(x) for x in version.split(".")[:2]) >= (2, 19)


def _resumes(results, mode):
    return {key: r for rank in results for key, r in rank["counter"][mode]["resume"]["resumed"].items()}


@pytest.mark.parametrize("version", list(APPLIED))
def test_empty_group_counters_resume_like_a_one_rank_run(launch, version):
    """Megatron's distributed-optimizer shards (no_weight_decay group empty on rank 1 only), 3 steps, TE's
    own state_dict per rank, resumed at 2, 3 and 1 ranks: every counter is the true step count after the
    load and after one more step, and every rank's params equal a one-rank run's bit for bit."""
    results = launch(version, 2)
    steps = 3
    for rank, r in enumerate(results):
        resume = r["counter"]["patched"]["resume"]
        assert resume["error"] is None, resume["error"]
        assert resume["before_save"] == [steps, steps], (rank, resume["before_save"])
    resumed = _resumes(results, "patched")
    assert sorted(resumed) == ["1:from0", "1:from1", "2:0", "2:1", "3:0", "3:1", "3:2"], sorted(resumed)
    assert resumed["2:1"]["holds"] == [2, 0] and resumed["3:2"]["holds"] == [1, 0]   # the empty groups
    for key, r in resumed.items():
        assert r["after_load"] == [steps, steps] and r["after_step"] == [steps + 1] * 2, (key, r)
        assert r["matches_reference"], key


@pytest.mark.parametrize("version", list(APPLIED))
def test_empty_group_counters_fail_on_te_s_own_code_before_2_19(launch, version):
    """The negative control: TE's own step leaves the empty group's counter behind, and a rank that
    resumes from that rank's file applies a wrong bias correction."""
    results = launch(version, 2)
    resumed = _resumes(results, "unpatched")
    if _fixed_upstream(version):
        assert all(r["after_step"] == [4, 4] and r["matches_reference"] for r in resumed.values()), resumed
        return
    assert results[1]["counter"]["unpatched"]["resume"]["before_save"] == [3, None]
    assert resumed["2:1"]["after_load"] == [3, None] and resumed["3:2"]["after_step"] == [4, 3]
    assert not resumed["1:from1"]["matches_reference"]                    # step 1's bias correction
    assert resumed["1:from0"]["matches_reference"] and resumed["2:0"]["matches_reference"]


@pytest.mark.parametrize("version", list(APPLIED))
def test_empty_group_counter_of_a_dtensor_optimizer(launch, version):
    for rank, r in enumerate(launch(version, 2)):
        got, own = r["counter"]["patched"]["dtensor"], r["counter"]["unpatched"]["dtensor"]
        assert got["error"] is None and got["counters"] == [2, 2], (rank, got)
        if own["error"] is None:   # TE's own DTensor path (some releases fail on it: test above)
            assert own["counters"] == ([2, 2] if _fixed_upstream(version) else [2, None]), (rank, own)


@pytest.mark.parametrize("version", [v for v in APPLIED if not _fixed_upstream(v)])
def test_counter_rule_is_te_2_19_s(launch, version):
    """The counters of empty groups around a group with params, and of a capturable optimizer, are what
    TE's own fixed code (2.20.2, the control) makes of the same steps: type, dtype, device and value."""
    control = launch("2.20.2", 2)[0]["counter"]["unpatched"]["exactness"]
    assert control["plain"] == [["int", 3]] * 3, control
    got = launch(version, 2)[0]["counter"]["patched"]["exactness"]
    assert got["plain"] == control["plain"], got
    if not isinstance(got["capturable"], str):
        assert got["capturable"] == control["capturable"] == [["Tensor", "torch.int32", "cpu", [2]]] * 2, got


@pytest.mark.parametrize("version", [v for v in APPLIED if not _fixed_upstream(v)])
def test_hooks_of_a_reverted_counter_patch_do_nothing(launch, version):
    got = launch(version, 2)[0]["counter"]["patched"]["reverted_hooks"]["counters"]
    assert got == [[1, 1], [2, 1], [3, 2]], got


# ----------------------------------------------------------------------------- te_fused_adam_empty_scale: FP8

@pytest.mark.parametrize("version", list(APPLIED))
def test_fp8_moments_of_an_expert_without_tokens_stay_finite(launch, version):
    """FP8 moments, an expert with zero grads: NaN from the second step on TE's own code (the negative
    control); finite and exactly zero through 3 steps, a state_dict save/load and one more step patched."""
    fp8 = launch(version, 2)[0]["fp8"]
    assert fp8["status"][_SCALE] == "applied", fp8["status"]
    own = fp8["unpatched"]["zero_expert"]
    assert own["finite_per_step"][1:] == [False, False] and not own["finite_after_resume"], own
    got = fp8["patched"]["zero_expert"]
    assert got == {"finite_per_step": [True] * 3, "loaded_zero": True, "finite_after_resume": True,
                   "live_finite": True}, got


@pytest.mark.parametrize("version", list(APPLIED))
def test_fp8_states_are_scaled_bit_for_bit_as_te_except_all_zero(launch, version):
    scaling = launch(version, 2)[0]["fp8"]["patched"]["scaling"]
    assert scaling["patched"] and scaling["control_caught"], scaling
    for name, got in scaling.items():
        if not isinstance(got, dict):
            continue
        assert got["finite"], (name, got)
        if name == "all_zero":   # TE: an infinite cast scale and NaN data; ours: scale 1, zeros
            assert not got["te_finite"] and got["scale"] == got["cast_scale"] == 1, got
        else:
            assert {k: v for k, v in got.items() if k not in ("finite", "te_finite")} == {
                "scale": 0, "scale_inv": 0, "data": 0, "cast_scale": 0, "dequantized": 0}, (name, got)
