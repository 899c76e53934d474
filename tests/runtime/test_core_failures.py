"""Failure policy (docs/design.md#36-failure-policy) and env toggles
(docs/design.md#32-environment-variables), each in a fresh interpreter."""
from tests.core_demo import IMPORT_PLUGIN, run_demo

FAILING = "demo_matrix_failing.yaml"


def test_lenient_failure_is_recorded_and_other_patches_go_on(tmp_path):
    result, proc = run_demo(tmp_path, """
import npu_fsdp_patches, demo_target
r = records()
emit(boom=(r["demo_boom"]["state"], r["demo_boom"]["error"]),
     missing=(r["demo_missing"]["state"], r["demo_missing"]["error"]),
     shout=r["demo_shout"]["state"], stop=demo_target.Engine().stop(), greet=demo_target.greet("x"))
""", matrix=FAILING)
    assert result["boom"] == ["failed", "RuntimeError: boom from demo_boom"]
    assert result["missing"] == ["failed", "target not found: demo_target:Engine.vanished"]
    assert result["shout"] == "applied" and result["greet"] == "hello x!"
    assert result["stop"] == "stopped"  # the failed patch left its target untouched
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("LOG WARNING")]
    assert warnings == ["LOG WARNING patch demo_boom failed: RuntimeError: boom from demo_boom",
                        "LOG WARNING patch demo_missing failed: target not found: demo_target:Engine.vanished"]
    assert "AttributeError" not in proc.stderr and "Traceback" not in proc.stderr


def test_strict_failure_raises_patch_error_from_the_target_import(tmp_path):
    result, _ = run_demo(tmp_path, """
import npu_fsdp_patches
try:
    import demo_target
except npu_fsdp_patches.PatchError as exc:
    emit(patch=exc.patch, target=exc.target, message=str(exc))
""", matrix=FAILING, NPU_FSDP_PATCHES_STRICT="1")
    assert result == {"patch": "demo_boom", "target": "demo_target:Engine.stop",
                      "message": "patch demo_boom failed at demo_target:Engine.stop: "
                                 "RuntimeError: boom from demo_boom"}


def test_enable_forces_a_gated_off_patch_and_makes_failures_raise(tmp_path):
    result, _ = run_demo(tmp_path, """
import npu_fsdp_patches, demo_target
r = records()["demo_gated_off"]
emit(reason=r["reason"], state=r["state"], explicit=r["explicit"], greet=demo_target.greet("x"))
""", NPU_FSDP_PATCHES_ENABLE="demo_gated_off", NPU_FSDP_PATCHES_DISABLE="demo_shout")
    assert result == {"reason": "forced by NPU_FSDP_PATCHES_ENABLE", "state": "applied",
                      "explicit": True, "greet": "hello x!"}
    result, _ = run_demo(tmp_path, """
import npu_fsdp_patches
try:
    import demo_target
    emit(raised=False)
except npu_fsdp_patches.PatchError as exc:
    emit(raised=True, patch=exc.patch)
""", matrix=FAILING, NPU_FSDP_PATCHES_ENABLE="demo_boom", NPU_FSDP_PATCHES_DISABLE="demo_missing")
    assert result == {"raised": True, "patch": "demo_boom"}


def test_disable_star_with_enable_allowlist(tmp_path):
    result, _ = run_demo(tmp_path, """
import npu_fsdp_patches
emit(states={n: (r["decision"], r["reason"]) for n, r in records().items()})
""", NPU_FSDP_PATCHES_DISABLE="*", NPU_FSDP_PATCHES_ENABLE="demo_child")
    states = result["states"]
    assert states.pop("demo_child") == ["enabled", "forced by NPU_FSDP_PATCHES_ENABLE"]
    assert {tuple(v) for v in states.values()} == {("disabled", "disabled by NPU_FSDP_PATCHES_DISABLE")}


def test_unknown_names_give_one_warning_listing_the_known_names(tmp_path):
    _, proc = run_demo(tmp_path, "import npu_fsdp_patches\n",
                       NPU_FSDP_PATCHES_DISABLE="nope_a,demo_shout", NPU_FSDP_PATCHES_ENABLE="nope_b")
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("LOG WARNING")]
    assert len(warnings) == 1
    assert "nope_a, nope_b" in warnings[0]
    assert "known patches: demo_absent, demo_child, demo_gated_off, demo_shout" in warnings[0]


def test_invalid_env_value_names_the_variable_and_the_import_survives(tmp_path):
    result, proc = run_demo(tmp_path, """
import npu_fsdp_patches, demo_target
emit(greet=demo_target.greet("x"), status=npu_fsdp_patches.status())
""", NPU_FSDP_PATCHES_DISABLE="demo;shout")
    assert result == {"greet": "hello x", "status": []}
    assert "NPU_FSDP_PATCHES_DISABLE='demo;shout' is not valid (demo;shout); accepted values: " in proc.stderr


def test_invalid_env_value_raises_in_strict_mode(tmp_path):
    result, _ = run_demo(tmp_path, IMPORT_PLUGIN, NPU_FSDP_PATCHES="maybe", NPU_FSDP_PATCHES_STRICT="1")
    assert result["raised"] == "ConfigError"
    assert result["message"].startswith("NPU_FSDP_PATCHES='maybe' is not valid; accepted values: 0 or 1")


def test_log_level_env_controls_the_logger(tmp_path):
    _, proc = run_demo(tmp_path, "import npu_fsdp_patches, demo_target\n",
                       NPU_FSDP_PATCHES_LOG="info", DEMO_TARGET_FIXED="1")
    assert "patch demo_shout skipped: upstream has it" in proc.stderr
