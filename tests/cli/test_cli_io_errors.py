"""The CLI never ends in a traceback (issue 28): an output it cannot write (a full disk, a closed or
read-only stdout, a closed pipe) and a bad ``report -o`` path give one line on stderr and exit code 2
(141 for a closed pipe), never 1, which means "a patch failed"; ``-o DIR/`` writes inside DIR; doctor
wraps a long path instead of cutting it. Each case runs the real command in a fresh interpreter."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.core_demo import demo_env
from tests.support import install_fixture

CLI = [sys.executable, "-m", "npu_fsdp_patches"]

#: cli.main with collect_report replaced by a canned report: the path handling, the writes and the
#: printing are the real ones, without doctor --import's probe interpreters (seconds per run)
REPORT_CHILD = r"""
import sys
from npu_fsdp_patches.cli import commands as cli, report
doctor = {"plugin": {"version": "0", "matrix": "m.yaml", "config_error": None},
          "environment": {"python": "3", "platform": "p", "torch": None, "device": None, "device_error": None,
                          "torch_npu": {"installed": False}},
          "frameworks": {}, "patches": [], "errors": [], "warnings": [], "exit_code": 0}
canned = {"schema": report.SCHEMA, "schema_version": 1,
          "system": {"os": "o", "kernel": "k", "machine": "m", "python": "3", "host": "h", "time": "t"},
          "packages": {}, "doctor": doctor, "self_test": {"skipped": "canned"},
          "ascend": {"cann_toolkit": {"version": "not found"}, "driver": {"version": "not found"},
                     "npu_smi": {"status": "not found"}}}
report.collect_report = lambda self_test, timeout: canned
sys.exit(cli.main(sys.argv[1:]))
"""


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("NPU_FSDP_PATCHES")}
    env.update(OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1", **extra)
    return env


def _run(cmd, cwd, stdout=subprocess.PIPE, timeout=120, **env):
    return subprocess.run(cmd, cwd=cwd, stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=timeout,
                          env=_env(**env))


def _one_line(proc, code=2):
    """The promise: exit ``code`` and one stderr line, no traceback (nor Python's exit-time flush error)."""
    lines = proc.stderr.splitlines()
    assert proc.returncode == code and len(lines) == 1 and lines[0].startswith("npu-fsdp-patches"), (
        proc.returncode, proc.stderr[-3000:])
    return lines[0]


def _report(tmp_path, *args, cwd=None, stdout=subprocess.PIPE):
    return _run([sys.executable, "-c", REPORT_CHILD, "report", "--no-self-test", *args], cwd or tmp_path,
                stdout=stdout, timeout=30)


@pytest.mark.parametrize("args", [("doctor",), ("list", "--json"), ("explain", "nope", "--json"), ("--help",),
                                  ("self-test",)])
def test_stdout_on_a_full_disk_is_one_line_and_exit_2(tmp_path, args):
    with open("/dev/full", "w", encoding="utf-8") as full:
        proc = _run([*CLI, *args], tmp_path, stdout=full)
    assert _one_line(proc) == "npu-fsdp-patches: cannot write to stdout: No space left on device"


def test_report_confirmation_on_a_full_disk_is_one_line_and_exit_2(tmp_path):
    with open("/dev/full", "w", encoding="utf-8") as full:
        proc = _report(tmp_path, "-o", "bug", stdout=full)
    assert _one_line(proc) == "npu-fsdp-patches: cannot write to stdout: No space left on device"
    assert (tmp_path / "bug.json").is_file()    # the files were written; only the confirmation was lost


@pytest.mark.parametrize("args", [("list",), ("--version",)])
def test_stdout_closed_or_read_only_is_one_line_and_exit_2(tmp_path, args):
    proc = _run(["bash", "-c", '"$@" >&-', "_", *CLI, *args], tmp_path)   # as a shell's `cmd >&-`
    assert _one_line(proc) == "npu-fsdp-patches: cannot write to stdout: it is closed"
    with open("/dev/null", encoding="utf-8") as read_only:                 # `cmd 1</dev/null`
        proc = _run([*CLI, *args], tmp_path, stdout=read_only)
    assert _one_line(proc) == "npu-fsdp-patches: cannot write to stdout: Bad file descriptor"


@pytest.mark.parametrize("args", [("list",), ("explain", "te_fused_adam_dtensor", "--json"), ("--help",)])
def test_a_pipe_whose_reader_is_gone_ends_quietly_with_141(tmp_path, args):
    """The reader leaves before anything is written (``| head -c1`` on a loaded machine): every write
    fails with EPIPE, so this is the deterministic form of the race."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = _run([*CLI, *args], tmp_path, stdout=write)
    finally:
        os.close(write)
    assert proc.returncode == 141 and proc.stderr == "", (proc.returncode, proc.stderr[-3000:])


def test_an_unwritable_stderr_does_not_turn_a_bad_configuration_into_a_traceback(tmp_path):
    with open("/dev/full", "w", encoding="utf-8") as full:
        proc = subprocess.run([*CLI, "list"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=full, text=True,
                              timeout=120, env=_env(NPU_FSDP_PATCHES_STRICT="maybe"))
    assert proc.returncode == 2 and proc.stdout == ""   # bad configuration, not 1 from an OSError


def test_ctrl_c_is_one_line_and_exit_130(tmp_path):
    code = ("import sys; from npu_fsdp_patches.cli import commands as cli\n"
            "def stop(argv): raise KeyboardInterrupt\n"
            "cli._run = stop; sys.exit(cli.main(['list']))")
    assert _one_line(_run([sys.executable, "-c", code], tmp_path), 130) == "npu-fsdp-patches: interrupted"


@pytest.mark.parametrize("output, cwd, inside", [
    (".", ".", "."), ("..", "a/b", "a"), ("a/", ".", "a"), ("a/.", ".", "a"), ("new/", ".", "new"),
    ("existing", ".", "existing"), ("a/b/../b", ".", "a/b")])
def test_report_to_a_folder_writes_both_files_inside_it_with_the_default_name(tmp_path, output, cwd, inside):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "existing").mkdir()
    proc = _report(tmp_path, "-o", output, cwd=tmp_path / cwd)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    folder = "" if inside == "." else inside + "/"
    assert written == [f"{folder}npu-fsdp-patches-report.json", f"{folder}npu-fsdp-patches-report.md"], written
    assert json.loads((tmp_path / folder / "npu-fsdp-patches-report.json").read_text())["schema_version"] == 1


def test_report_to_the_root_folder_names_files_inside_it():
    """Not run for real: the tests run as root and would write into /."""
    from npu_fsdp_patches.cli.report import output_paths
    assert output_paths("/") == (Path("/npu-fsdp-patches-report.json"), Path("/npu-fsdp-patches-report.md"))
    assert output_paths("/tmp/bug.md") == (Path("/tmp/bug.json"), Path("/tmp/bug.md"))   # unchanged


def test_report_with_an_empty_output_is_a_usage_error(tmp_path):
    line = _one_line(_report(tmp_path, "-o", ""))
    assert line == "npu-fsdp-patches report: -o needs a path, got an empty string"
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("seconds", ["nan", "inf", "-5"])
def test_report_with_an_unusable_self_test_timeout_is_a_usage_error(tmp_path, seconds):
    """Refused before anything runs; nan and inf raised in subprocess.run, -5 ran doctor for nothing."""
    line = _one_line(_run([*CLI, "report", "-o", "r", f"--self-test-timeout={seconds}"], tmp_path))
    assert line.startswith(f"npu-fsdp-patches report: --self-test-timeout {seconds}: need a finite"), line
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("output", ["file/bug", "file/sub/", "/proc/npu-fsdp-patches-nowhere/bug", "fifo"])
def test_report_to_an_unusable_path_is_one_line_and_exit_2(tmp_path, output):
    """A parent that is a file or cannot be created, and a FIFO at the path (never waited on)."""
    (tmp_path / "file").write_text("")
    os.mkfifo(tmp_path / "fifo.json")
    line = _one_line(_report(tmp_path, "-o", output))
    assert line.startswith("npu-fsdp-patches report: cannot write "), line


def test_report_path_with_an_undecodable_byte_is_written_and_printed_escaped(tmp_path):
    proc = subprocess.run([os.fsencode(sys.executable), b"-c", REPORT_CHILD.encode(), b"report", b"-o", b"bug\xff"],
                          cwd=tmp_path, capture_output=True, timeout=30, env=_env(PYTHONIOENCODING="utf-8"))
    assert proc.returncode == 0 and b"Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert os.path.isfile(os.path.join(os.fsencode(tmp_path), b"bug\xff.json"))
    assert proc.stdout.decode() == "wrote bug\\udcff.json and bug\\udcff.md\n"


def test_real_report_to_a_folder_with_a_trailing_slash(tmp_path):
    """End to end, without the canned report: doctor --import runs and both files land inside sub/."""
    proc = _run([*CLI, "report", "--no-self-test", "-o", "sub/"], tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["npu-fsdp-patches-report.json",
                                                                     "npu-fsdp-patches-report.md"]
    assert not (tmp_path / "sub.json").exists()


def _continued(lines, row):
    """The value wrapped below ``lines[row]``: its continuation lines, joined."""
    out = []
    for line in lines[row + 1:]:
        if not line.startswith("      /") and not (out and out[-1].endswith("/") and line.startswith("      ")):
            break
        out.append(line.strip())
    return "".join(out)


def test_doctor_shows_a_long_location_and_matrix_whole_wrapped_never_cut(tmp_path):
    """The demo framework and its matrix installed under a path longer than a doctor line."""
    site = install_fixture("core_demo", tmp_path.joinpath(*["a-rather-long-folder-name"] * 5))
    proc = _run([*CLI, "doctor"], tmp_path, timeout=300, PYTHONPATH=str(site), **demo_env(site))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert max(len(line) for line in lines) <= 100 and not any("…" in line for line in lines)
    row = lines.index("  demo                1.2.0                    metadata")
    assert _continued(lines, row) == str(site / "demo_target"), lines[row:row + 4]
    title = lines.index("Patches (matrix below)")
    assert _continued(lines, title) == str(site / "demo_matrix.yaml"), lines[title:title + 4]


def test_doctor_render_keeps_a_path_that_fits_a_line_on_one_line_and_splits_only_after_a_slash():
    from npu_fsdp_patches.cli.render import doctor_text
    medium = "/opt/conda/envs/train/lib/python3.11/site-packages/megatron/core/with/a/longer/tail"   # 84 chars
    long = "/scratch" + "/deeply-nested-folder" * 6 + "/site-packages/megatron/core"
    matrix = "/etc" + "/config-folder" * 7 + "/compat_matrix.yaml"
    fw = {"installed": True, "version": "0.16.1", "flavor": None, "commit": None, "source": "metadata",
          "distribution": "megatron-core"}
    report = {"plugin": {"version": "0", "matrix": matrix, "config_error": None},
              "environment": {"python": "3", "platform": "p", "torch": "2", "device": "cpu", "device_error": None,
                              "torch_npu": {"installed": False}},
              "frameworks": {"megatron_core": {**fw, "location": medium}, "mindspeed": {**fw, "location": long}},
              "patches": [{"name": "p", "decision": "disabled", "state": "disabled", "reason": "r", "error": None,
                           "note": None, "provenance": None}], "errors": [], "warnings": [], "exit_code": 0}
    lines = doctor_text(report).splitlines()
    assert max(len(line) for line in lines) <= 100 and not any("…" in line for line in lines)
    assert "      " + medium in lines                                   # whole, on its own line
    row = lines.index(next(line for line in lines if line.startswith("  mindspeed ")))
    assert lines[row + 1].startswith("      /scratch/") and lines[row + 1].endswith("/")   # split after a /
    assert _continued(lines, row) == long
    assert _continued(lines, lines.index("Patches (matrix below)")) == matrix
    report["plugin"]["matrix"] = "/etc/compat_matrix.yaml"                  # a short one stays on the title
    assert "Patches (matrix: /etc/compat_matrix.yaml)" in doctor_text(report).splitlines()
