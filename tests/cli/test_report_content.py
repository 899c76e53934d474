"""What a bug report carries (issue 31): every failed self-test check says why in the JSON and in the
Markdown, the self-test lines have no ``None`` and line up, and ``report`` says which stage it is in."""
import os
import subprocess
import sys
from pathlib import Path

from npu_fsdp_patches.cli.report import markdown
from npu_fsdp_patches.selftest.report import check_line, merge, skipped

RAISED = {"passed": False, "error": "RuntimeError: Found empty `transformer-engine` meta package installed",
          "traceback": "Traceback ...", "seconds": 0.5}
DRIFTED = {"passed": False, "elements": 10, "mismatches": 2, "max_abs_error": 0.0078125, "tolerance": "bitwise",
           "first_mismatch": {"what": "exp_avg", "index": [3], "expected": 1.0, "got": 1.0078125}, "seconds": 1.0}
PASSED = {"passed": True, "elements": 10, "mismatches": 0, "max_abs_error": 0.0, "tolerance": "bitwise",
          "seconds": 1.25}


def test_a_failed_check_carries_its_reason_in_the_json():
    raised = merge("te_fused_adam", [RAISED, {**PASSED}])
    assert raised["status"] == "failed"
    assert raised["reason"] == "error on rank 0: RuntimeError: Found empty `transformer-engine` meta package installed"
    drifted = merge("adamw_step", [dict(PASSED), dict(DRIFTED)])
    assert drifted["reason"] == ("2 mismatches (max abs error 0.00781, tolerance bitwise); first: rank 1 exp_avg "
                                 "index [3]: expected 1.0 got 1.0078125")
    assert merge("adamw_step", [dict(PASSED), dict(PASSED)])["reason"] is None


def _report_with(checks):
    doctor = {"plugin": {"version": "0", "matrix": "m.yaml", "config_error": None},
              "environment": {"python": "3", "platform": "p", "torch": None, "device": None, "device_error": None,
                              "torch_npu": {"installed": False}},
              "frameworks": {}, "patches": [], "errors": [], "warnings": [], "exit_code": 0}
    return {"system": {"os": "Linux", "kernel": "Linux 5", "machine": "x", "python": "3", "host": "h", "time": "t"},
            "packages": {}, "doctor": doctor,
            "ascend": {"cann_toolkit": {"version": "not found"}, "driver": {"version": "not found"},
                       "npu_smi": {"status": "not found"}},
            "self_test": {"exit_code": 1, "result": {"passed": False, "device": "cpu", "backend": "gloo",
                                                     "world_size": 2, "checks": checks}}}


def test_the_markdown_table_shows_why_a_check_failed():
    check = merge("te_fused_adam", [RAISED, dict(PASSED)])
    md = markdown(_report_with([check]), "r.json")
    assert ("| te_fused_adam | failed | error on rank 0: RuntimeError: Found empty `transformer-engine` meta "
            "package installed |") in md
    older = {**check, "reason": None}   # a self-test JSON that did not carry the reason yet
    assert "| te_fused_adam | failed | error on rank 0: RuntimeError" in markdown(_report_with([older]), "r.json")


def test_a_self_test_that_could_not_run_shows_its_exit_code_and_why():
    report = _report_with([])
    why = "npu-fsdp-patches self-test: numpy cannot be imported (ModuleNotFoundError: No module named 'numpy')"
    report["self_test"] = {"exit_code": 2, "error": "the self-test printed no JSON result", "stderr_tail": why + "\n"}
    md = markdown(report, "r.json")
    assert f"Error (exit code 2): the self-test printed no JSON result.\n\n```text\n{why}\n```" in md, md
    report["self_test"] = {"error": "cannot start the self-test: [Errno 2] No such file"}
    assert "Error: cannot start the self-test: [Errno 2] No such file." in markdown(report, "r.json")


def test_self_test_lines_have_no_none_and_their_columns_line_up():
    raised = merge("te_fused_adam", [RAISED, dict(PASSED)])
    lines = [check_line(merge("adamw_step", [dict(PASSED), dict(PASSED)])).splitlines()[0],
             check_line(raised).splitlines()[0],
             check_line({**merge("fused_adam", [dict(PASSED)]), "patches": ["te_fused_adam_dtensor"]}),
             check_line(skipped("hyper_skip_dispatch", "patch hp_skip_dispatch_adamw is disabled"))]
    assert not any("None" in line for line in lines), lines
    assert "tolerance -" in lines[1] and lines[2].endswith("(patch te_fused_adam_dtensor)")
    starts = {line.index(" s  elements") for line in lines[:3]}
    assert len(starts) == 1, lines
    assert lines[3].index("patch hp_skip") == lines[0].index("elements"), lines
    assert "error on rank 0: RuntimeError" in check_line(raised)


def test_report_says_each_stage_on_stderr(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NPU_FSDP_PATCHES", "ASCEND_"))}
    env.update(PATH=f"/nonexistent{os.pathsep}{os.path.dirname(sys.executable)}", OMP_NUM_THREADS="1")
    proc = subprocess.run([str(Path(sys.executable).parent / "npu-fsdp-patches"), "report", "--no-self-test",
                           "-o", str(tmp_path / "bug")], capture_output=True, text=True, timeout=600, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stages = [line for line in proc.stderr.splitlines() if line.startswith("npu-fsdp-patches report: [")]
    assert [line.split("]")[0][-3:] for line in stages] == ["1/4", "2/4", "3/4", "4/4"], proc.stderr
    assert stages[0].startswith("npu-fsdp-patches report: [1/4] doctor --import")
    assert stages[3] == "npu-fsdp-patches report: [4/4] self-test skipped: --no-self-test was given"
