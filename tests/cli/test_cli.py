"""The CLI as users start it: a pipe closed early, ``python -mMODULE`` in strict mode, ``python -I``,
explain's gate, and the one activation summary line (issue 18 item 7 and 9, issue 20)."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.core_demo import demo_env
from tests.support import REPO_ROOT, install_fixture, run_python

SCRIPT = str(Path(sys.executable).parent / "npu-fsdp-patches")


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("NPU_FSDP_PATCHES")}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


@pytest.mark.parametrize("args", [("list",), ("doctor", "--json")])
def test_a_pipe_closed_early_ends_quietly(demo_site, args):
    """Like ``| head -1``: the reader reads one line (or none) and leaves; three runs each."""
    env = _env(PYTHONPATH=str(demo_site), **demo_env(demo_site))
    for read_first_line in (False, True, True)[:3 if args == ("list",) else 2]:
        proc = subprocess.Popen([SCRIPT, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        if read_first_line:
            assert proc.stdout.readline()
        proc.stdout.close()            # before the child wrote (or finished writing) its output
        stderr = proc.stderr.read().decode()
        code = proc.wait(timeout=300)
        assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr
        assert code in (0, 141), (code, stderr)


def test_dash_m_glued_to_the_module_in_strict_mode_gives_json_and_no_traceback(tmp_path):
    for start in (["-mnpu_fsdp_patches"], ["-Im", "npu_fsdp_patches"], ["-X", "utf8", "-m", "npu_fsdp_patches"]):
        proc = subprocess.run([sys.executable, *start, "doctor", "--json"], capture_output=True, text=True,
                              timeout=300, cwd=tmp_path,
                              env=_env(NPU_FSDP_PATCHES_STRICT="1", NPU_FSDP_PATCHES_DISABLE="a;b"))
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, (start, proc.stderr[-2000:])
        assert json.loads(proc.stdout)["plugin"]["config_error"].startswith("NPU_FSDP_PATCHES_DISABLE='a;b'")


def test_under_python_dash_I_frameworks_and_patches_agree(tmp_path):
    """-I ignores PYTHONPATH: hyper-parallel there is not installed for doctor, nor for its probe children."""
    hyper = install_fixture("hyper_parallel_new", tmp_path)
    proc = subprocess.run([sys.executable, "-I", "-m", "npu_fsdp_patches", "doctor", "--json", "--import"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env=_env(PYTHONPATH=str(hyper)))
    report = json.loads(proc.stdout)
    assert report["frameworks"]["hyper_parallel"]["installed"] is False
    hp = {p["name"]: (p["decision"], p["state"]) for p in report["patches"] if p["name"].startswith("hp_")}
    assert hp and set(hp.values()) == {("disabled", "disabled")}, hp
    # the control: without -I the same PYTHONPATH shows hyper-parallel to both sections
    proc = subprocess.run([sys.executable, "-m", "npu_fsdp_patches", "doctor", "--json"], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path, env=_env(PYTHONPATH=str(hyper)))
    report = json.loads(proc.stdout)
    assert report["frameworks"]["hyper_parallel"]["installed"] is True
    assert {p["decision"] for p in report["patches"] if p["name"].startswith("hp_")} == {"enabled"}


def test_explain_shows_each_gate_alternative_for_a_missing_framework_and_json_gives_the_gate():
    code = """
import contextlib, io, json
from npu_fsdp_patches.cli import main
out = {}
for args in (["explain", "te_fused_adam_dtensor"], ["explain", "te_fused_adam_dtensor", "--json"]):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        main(args)
    out[args[-1]] = buf.getvalue()
print(json.dumps(out))
"""
    out = json.loads(run_python(code).stdout.splitlines()[-1])
    lines = [line for line in out["te_fused_adam_dtensor"].splitlines() if re.match(r"  \[\d+\] ", line)]
    assert len(lines) == 2 and len(set(lines)) == 2, lines     # the alternatives no longer read the same
    assert lines[0].startswith("  [1] no  transformer-engine [npu flavour] (any version): ")
    assert lines[1].startswith("  [2] no  transformer-engine [nvidia flavour] <2.14,>=2.10: ")
    assert lines[0].endswith(": transformer-engine not installed")
    assert "\nWhy: NVTE 2.10/2.11 keep plain global-shape states" in out["te_fused_adam_dtensor"]  # matrix `why`
    gate = json.loads(out["--json"])["gate"]
    assert [a["alternative"] for a in gate] == [1, 2] and not any(a["holds"] for a in gate)
    te = gate[1]["conditions"][0]
    assert (te["framework"], te["flavor"], te["version"], te["holds"]) == (
        "transformer_engine", "nvidia", "<2.14,>=2.10", False)
    torch = gate[0]["conditions"][1]
    assert (torch["framework"], torch["version"], torch["holds"]) == ("torch", ">=2.6", True)


SUMMARY_CHILD = """
import logging, sys
import npu_fsdp_patches
print("ACTIVATED", flush=True)
if sys.argv[1] == "import":
    import demo_target
print("IMPORTED", flush=True)
"""


def _summary_run(site, mode, **env):
    proc = subprocess.run([sys.executable, "-c", SUMMARY_CHILD, mode], capture_output=True, text=True,
                          timeout=180, env=_env(PYTHONPATH=str(site), **demo_env(site), **env))
    assert proc.returncode == 0, proc.stderr
    return [line for line in proc.stderr.splitlines() if "patches enabled" in line]


def test_activation_summary_one_line_when_the_last_patch_settles(demo_site):
    lines = _summary_run(demo_site, "import", NPU_FSDP_PATCHES_LOG="info")
    assert lines == ["INFO npu_fsdp_patches: npu_fsdp_patches: 2 of 4 patches enabled: applied demo_shout, "
                     "demo_child"], lines
    # a target never imported: the line comes at exit and names what still waits
    lines = _summary_run(demo_site, "none", NPU_FSDP_PATCHES_LOG="info")
    assert lines == ["INFO npu_fsdp_patches: npu_fsdp_patches: 2 of 4 patches enabled: pending demo_shout "
                     "(waits for import of demo_target), demo_child (waits for import of demo_target)"], lines
    # nothing enabled: the line comes at activation
    assert _summary_run(demo_site, "none", NPU_FSDP_PATCHES_LOG="info", NPU_FSDP_PATCHES_DISABLE="*") == [
        "INFO npu_fsdp_patches: npu_fsdp_patches: 0 of 4 patches enabled"]
    assert _summary_run(demo_site, "import", NPU_FSDP_PATCHES_LOG="info", RANK="1") == []   # rank 0 only
    assert _summary_run(demo_site, "import", NPU_FSDP_PATCHES_LOG="warning") == []


def test_activation_summary_comes_when_the_last_patch_settles_not_at_exit(demo_site):
    proc = subprocess.run([sys.executable, "-c", SUMMARY_CHILD + "import sys; sys.stderr.write('END\\n')\n",
                           "import"], capture_output=True, text=True, timeout=180,
                          env=_env(PYTHONPATH=str(demo_site), **demo_env(demo_site), NPU_FSDP_PATCHES_LOG="info"))
    err = proc.stderr
    assert err.index("patches enabled") < err.index("END"), err


def test_activation_summary_names_failures(tmp_path):
    site = install_fixture("core_demo", tmp_path)
    proc = subprocess.run([sys.executable, "-c", SUMMARY_CHILD, "import"], capture_output=True, text=True,
                          timeout=180, env=_env(PYTHONPATH=str(site), **demo_env(site, "demo_matrix_failing.yaml"),
                                                NPU_FSDP_PATCHES_LOG="info"))
    [line] = [line for line in proc.stderr.splitlines() if "patches enabled" in line]
    assert "failed demo_boom, demo_missing" in line and "applied demo_shout" in line, line
