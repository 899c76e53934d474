"""``npu-fsdp-patches report`` (issue 20): one JSON file and its Markdown, with a fake Ascend tree
(ASCEND_TOOLKIT_HOME pointing to tmp) and a fake ``npu-smi`` on PATH (tests/fixtures/ascend/npu-smi,
the real tool's table layout). Missing or unreadable facts say so and never fail the report."""
import json
import os
import subprocess
import sys
from pathlib import Path

from npu_fsdp_patches.cli import report_env
from tests.support import FIXTURES

FAKE_BIN = FIXTURES / "ascend"
SCRIPT = str(Path(sys.executable).parent / "npu-fsdp-patches")


def _toolkit(root: Path, form: str) -> Path:
    home = root / "ascend-toolkit" / "latest"
    if form == "version.cfg":
        home.mkdir(parents=True)
        (home / "version.cfg").write_text("runtime_running_version=[7.3.0.1.231:8.0.RC2]\n"
                                          "toolkit_running_version=[7.3.0.1.231:8.0.RC2]\n")
    else:
        (home / "aarch64-linux").mkdir(parents=True)
        (home / "aarch64-linux" / "ascend_toolkit_install.info").write_text(
            "package_name=Ascend-cann-toolkit\nversion=8.1.RC1\ninnerversion=V100R001C21\n")
    return home


def test_cann_toolkit_and_driver_from_a_fake_ascend_tree(tmp_path):
    cfg = _toolkit(tmp_path / "a", "version.cfg")
    assert report_env.cann_toolkit({"ASCEND_TOOLKIT_HOME": str(cfg)}) == {
        "version": "8.0.RC2", "source": str(cfg / "version.cfg")}
    info = _toolkit(tmp_path / "b", "install.info")
    found = report_env.cann_toolkit({"ASCEND_HOME_PATH": str(info)})
    assert found["version"] == "8.1.RC1" and found["source"].endswith("ascend_toolkit_install.info")
    missing = report_env.cann_toolkit({"ASCEND_HOME_PATH": str(tmp_path / "nowhere")})
    assert missing["version"] == "not found" and str(tmp_path / "nowhere") in missing["searched"]
    (tmp_path / "driver").mkdir()
    (tmp_path / "driver" / "version.info").write_text("Version=23.0.6\nascendhal_version=7.35.19\n")
    assert report_env.driver(str(tmp_path))["version"] == "23.0.6"
    assert report_env.driver(str(tmp_path / "nowhere"))["version"] == "not found"


def test_npu_smi_device_list_and_every_way_it_can_fail(monkeypatch):
    monkeypatch.setenv("PATH", f"{FAKE_BIN}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("NPU_SMI_FAKE", raising=False)
    found = report_env.npu_smi()
    assert (found["status"], found["count"], found["models"], found["version"]) == ("ok", 2, {"910B3": 2}, "23.0.6")
    assert [d["health"] for d in found["devices"]] == ["OK", "Warning"]      # the process table is ignored
    monkeypatch.setenv("NPU_SMI_FAKE", "garbled")
    garbled = report_env.npu_smi()
    assert garbled["status"] == "unreadable (no device rows recognised)" and "dcmi" in garbled["output_tail"]
    monkeypatch.setenv("NPU_SMI_FAKE", "hang")
    assert report_env.npu_smi(timeout=1)["status"] == "timed out after 1s"
    monkeypatch.setenv("PATH", "/nonexistent")
    assert report_env.npu_smi() == {"status": "not found"}


def test_report_writes_json_and_markdown_with_every_section(tmp_path):
    toolkit = _toolkit(tmp_path, "version.cfg")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NPU_FSDP_PATCHES", "ASCEND_"))}
    env.update(PATH=f"{FAKE_BIN}{os.pathsep}{env['PATH']}", ASCEND_TOOLKIT_HOME=str(toolkit), OMP_NUM_THREADS="1")
    # the self-test runs as a child; a 1 s limit makes it stop early and report that (the wiring, not the checks)
    proc = subprocess.run([SCRIPT, "report", "-o", str(tmp_path / "out" / "bug.json"), "--self-test-timeout", "1"],
                          capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "out" / "bug.json").read_text())
    assert (data["schema"], data["schema_version"]) == ("npu-fsdp-patches/report", 2)
    assert data["doctor"]["schema"] == "npu-fsdp-patches/doctor" and data["doctor"]["patches"]
    assert set(data["system"]) == {"os", "kernel", "machine", "python", "host", "time"}
    assert data["packages"]["torch"]["version"].startswith("2.") and data["packages"]["torch"]["importable"]
    assert data["packages"]["mindspeed"]["found"] == "not found"
    assert data["ascend"]["cann_toolkit"]["version"] == "8.0.RC2"
    assert data["ascend"]["npu_smi"]["models"] == {"910B3": 2}
    st = data["self_test"]
    assert st["result"]["schema"] == "npu-fsdp-patches/self-test" and st["exit_code"] == st["result"]["exit_code"]
    md = (tmp_path / "out" / "bug.md").read_text()
    assert "| CANN toolkit | 8.0.RC2 |" in md and "| NPUs | 2 x 910B3 (npu-smi 23.0.6) |" in md
    assert "### Doctor (exit code" in md and "npu-fsdp-patches 0.1.0 doctor" in md and "### Self-test" in md
    assert f"wrote {tmp_path / 'out' / 'bug.json'} and {tmp_path / 'out' / 'bug.md'}" in proc.stdout


def test_report_markdown_says_why_the_self_test_was_skipped_and_what_was_not_found():
    from npu_fsdp_patches.cli.report import markdown
    doctor = {"plugin": {"version": "0", "matrix": "m.yaml", "config_error": None},
              "environment": {"python": "3", "platform": "p", "torch": None, "device": None, "device_error": None,
                              "torch_npu": {"installed": False}},
              "frameworks": {}, "patches": [], "errors": [], "warnings": [], "exit_code": 0}
    report = {"system": {"os": "Linux", "kernel": "Linux 5", "machine": "x", "python": "3", "host": "h",
                         "time": "t"}, "doctor": doctor,
              "packages": {"torch": {"version": None, "found": "not found", "location": None, "framework": "torch",
                                     "needed_by": [], "importable": None, "import_error": None}},
              "ascend": {"cann_toolkit": {"version": "not found"}, "driver": {"version": "not found"},
                         "npu_smi": {"status": "not found"}},
              "self_test": {"skipped": "--no-self-test was given"}}
    md = markdown(report, "r.json")
    assert "| CANN toolkit | not found |" in md and "| NPU driver | not found |" in md
    assert "| NPUs | npu-smi: not found |" in md and "Skipped: --no-self-test was given." in md
    assert "| torch | - | not found | framework torch |" in md
    assert "Detection environment: PYTHONPATH unset; no framework variable applies." in md


def test_report_to_a_path_it_cannot_write_exits_2_at_once(tmp_path):
    (tmp_path / "file").write_text("")
    proc = subprocess.run([SCRIPT, "report", "-o", str(tmp_path / "file" / "bug")], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)    # before doctor and the self-test run
    assert proc.returncode == 2 and f"cannot write {tmp_path / 'file' / 'bug.json'}" in proc.stderr
    assert "Traceback" not in proc.stderr
