"""MainParamsOptimizer on hyper-parallel DTensor params (docs/design.md#43-hp_fp32_main_params), against the stand-in
tests/fixtures/hyper_parallel_new (docs/hyper_parallel.md#43-task-3-main_grad, #44-task-4-hyper-dtensor-api).

One fresh interpreter (rank code: tests/children/main_params_hyper.py), one process, mesh (1,): every model param is a hyper DTensor registered as a
parameter; ops on it fail outside ``SkipDTensorDispatch``. The wrapper is built, fed grads and
zeroed outside that context; the step runs inside it, as hyper's trainer runs it. Each step is
compared bit for bit with the same wrapper over plain tensors holding the same local values.

Params, grads and groups (the hyper side; the plain side mirrors it with plain tensors):
* ``w`` bf16 Shard(0), fp32 ``main_grad`` DTensor and no ``grad`` (apply_grad_on_fp32_main_grad);
* ``b`` bf16 Replicate, bf16 ``grad`` DTensor (no main_grad);
* ``c`` fp32 Replicate, its own main param, fp32 ``main_grad``;
* ``u`` bf16 Shard(0) in a second group with a large lr, so its bf16 value really moves.
``w``/``b``/``c`` use lr 1e-4: three AdamW steps move them by ~3e-4, under half a bf16 ulp of
values in [0.5, 1.5), so only an fp32 main param can hold the update.
"""
from tests.support import run_case


def test_main_params_on_hyper_dtensors(hyper_site):
    results = run_case("tests.children.main_params_hyper:variants", paths=[hyper_site], timeout=180)
    for variant, out in results.items():
        where = f"AdamW {variant}"
        assert out["layout"] == [], f"{where}: bad main param layout for {out['layout']}"
        assert out["groups_hold_mains"], where
        assert out["mismatch"] == [[], [], []], f"{where}: differs from the plain-tensor run: {out['mismatch']}"
        for step, alias in enumerate(out["alias"]):
            assert all(alias.values()), f"{where} step {step}: {alias}"
        assert out["zeroed"] == [True, True, True], where
        assert out["tails"] == {"w": True, "b": True}, f"{where}: main params hold bf16 values: {out['tails']}"
        assert out["small_lr_bf16_unmoved"] and out["large_lr_bf16_moved"], where
        assert out["ulp_caught_fp32"] and out["ulp_caught_bf16"], where
        assert out["sd_keys"] == [["b", "c", "u", "w"], ["b", "u", "w"], []], where   # the section only
        assert out["sd_section_is_mains"] and out["loaded_mains_exact"], where
        assert out["after_load_mismatch"] == [], f"{where}: {out['after_load_mismatch']}"
        assert out["dcp_dir_empty"], where
        for message in out["dcp_errors"]:
            assert message is not None and "'w'" in message and "hyper_parallel" in message, message


def test_two_leaves_over_hyper_dtensors_use_upstreams_flattened_layout(hyper_site):
    """hyper-parallel's ChainedOptimizer flattens a multi-optimizer state (docs/main_params.md §2.1):
    over hyper DTensors ours writes that layout, main params in the section only, and reads it back."""
    out = run_case("tests.children.main_params_hyper:two_leaves", paths=[hyper_site], timeout=180)
    assert out["nested"] is False
    assert out["state_keys"] == [f"state.{n}.{k}" for n in ("b", "c", "u", "w")
                                 for k in ("exp_avg", "exp_avg_sq", "step")], out["state_keys"]
    assert out["group_lrs"] == {"param_groups.w.lr": 1e-4, "param_groups.b.lr": 1e-4,
                                "param_groups.c.lr": 1e-4, "param_groups.u.lr": 1e-2}, out["group_lrs"]
    assert out["section"] == ["b", "u", "w"]
    assert out["mains_exact"] and out["moments_exact"]
