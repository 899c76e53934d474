"""``python -OO -m npu_fsdp_patches explain NAME`` keeps each patch's description (issue 42).

``-OO`` strips docstrings, and a patch's description is its class docstring; explain reads it as data from the
patch module's source (plan/declarations.py), so the text is the same with and without ``-OO``. Where neither
the source nor the loaded class has one, explain says the description is missing instead of leaving it out.
"""
import os
import subprocess
import sys

import pytest

from npu_fsdp_patches.plan.matrix import SHIPPED_MATRIX, load_matrix
from tests.support import REPO_ROOT, run_python

NAMES = sorted(load_matrix(SHIPPED_MATRIX).patches)


def _explain(name: str, *flags: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NPU_FSDP_PATCHES")}
    proc = subprocess.run([sys.executable, *flags, "-m", "npu_fsdp_patches", "explain", name], env=env,
                          cwd=str(REPO_ROOT), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.parametrize("name", NAMES)
def test_explain_under_OO_keeps_the_description(name):
    optimized = _explain(name, "-OO")
    assert "What it changes:" in optimized and "(missing:" not in optimized
    assert optimized == _explain(name)


def test_a_patch_without_a_description_says_it_is_missing():
    code = f"""
from npu_fsdp_patches.cli import commands
commands._patch_doc = lambda name: None   # no source, no docstring
commands.main(["explain", {NAMES[0]!r}])
"""
    text = run_python(code).stdout
    assert "What it changes:\n  (missing: the patch's description is its class docstring" in text
    assert max(len(line) for line in text.splitlines()) <= 100
