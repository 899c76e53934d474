"""The CPU path of the prepared device run, benchmarks/device_run.sh (docs/performance.md#the-prepared-device-run).

CI runs it as ``bash benchmarks/device_run.sh cpu --quick``: the self-test's adamw_step check, two examples
(megatron_te_fused_adam.py fails here, where megatron-core is not installed, which exercises "one failure
never stops the run"), the compiled-step benchmark and the main-params step benchmark at tiny sizes, on 2
gloo ranks.
"""
from __future__ import annotations

import os
import subprocess
import sys

from tests.support import REPO_ROOT

SCRIPT = REPO_ROOT / "benchmarks" / "device_run.sh"


def _run(*args, out, timeout=240, python=sys.executable):
    env = {k: v for k, v in os.environ.items() if not k.startswith("NPU_FSDP_PATCHES")}
    env.update(OUT=str(out), PYTHON=str(python))
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=str(REPO_ROOT), env=env, capture_output=True,
                          text=True, timeout=timeout)


def _python_failing_on(tmp_path, script: str):
    """A python that exits 3 for a command naming ``script`` (fault injection) and is the real one otherwise."""
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nfor a in "$@"; do case "$a" in *{script}) echo "injected failure" >&2; exit 3;; '
                       f'esac; done\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def test_cpu_quick_run_writes_one_results_file_and_reports_what_failed(tmp_path):
    """One item fails (injected: the fsdp2_vs_foreach_adamw example, which its own test runs for real); the
    run goes on, reports it, and exits 1."""
    out = tmp_path / "out"
    out.mkdir()
    proc = _run("cpu", "--quick", out=out, python=_python_failing_on(tmp_path, "fsdp2_vs_foreach_adamw.py"))
    files = list(out.iterdir())
    assert [f.name for f in files] == ["device_run_cpu.txt"], files
    text = files[0].read_text()
    summary = text[text.index("=== summary: cpu"):].splitlines()
    lines = {line.split()[1] + " " + line.split()[2].rstrip(":"): line.split()[0] for line in summary[1:]
             if line.split() and line.split()[0] in ("ok", "FAILED", "TIMEOUT", "skipped", "NOT")}
    assert lines.get("self-test (adamw_step)") == "ok", text[-4000:]
    assert lines.get("example fsdp2_vs_foreach_adamw.py") == "FAILED", text[-4000:]
    assert "injected failure" in text
    # ran after the failed example: one failure does not stop the run
    assert lines.get("benchmark compiled_step.py") == "ok", text[-4000:]
    assert "foreach" in text and "main_params" in text and "ours/torch compiled" in text
    # megatron-core is not installed here: the example says what it needs, and the run lists it as not run
    # with that line instead of failing (where megatron-core and TE are installed it runs)
    megatron = next(line for line in summary if "example megatron_te_fused_adam.py" in line)
    assert megatron.startswith(("ok ", "NOT RUN ")), megatron
    if megatron.startswith("NOT RUN"):
        assert "megatron_te_fused_adam.py needs " in megatron, megatron
    assert lines.get("benchmark fused_adam_step.py") == "skipped"
    failed = [name for name, status in lines.items() if status in ("FAILED", "TIMEOUT")]
    assert failed == ["example fsdp2_vs_foreach_adamw.py"], failed
    assert proc.returncode == 1, proc.returncode
    assert "results file: " + str(files[0]) in proc.stdout


def test_unknown_device_is_a_usage_error(tmp_path):
    proc = _run("tpu", out=tmp_path, timeout=30)
    assert proc.returncode == 2 and "usage:" in proc.stderr
    assert list(tmp_path.iterdir()) == []
