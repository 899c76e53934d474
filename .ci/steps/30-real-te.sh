#!/usr/bin/env bash
# Real TE sources: every verified transformer-engine wheel must be fetchable and laid out.
#
# The README test command already runs tests/test_te_real.py (with te_fused_adam_empty_group_step's and
# the FP8 cases in each release's launch), test_te_fused_adam_patch.py, test_te_fix_probes.py,
# test_megatron_initialize_state.py and test_megatron_empty_group_step.py on the real FusedAdam of each
# release (tests/te_real.py
# downloads the pure-Python wheels with `pip download --no-deps` into
# ~/.cache/npu_fsdp_patches/te-wheels); locally a missing wheel only skips them. This step makes a
# missing wheel a CI failure (NPU_FSDP_TESTS_REQUIRE_TE_WHEELS=1) and re-runs the cheap real-TE
# checks under that rule, so a skipped real-TE run can never pass CI.
# Measured (2 cores, shared): 10 wheels, 8.4 MB, ~117 s cold download (the TENPU stand-in's base
# 2.15.0 and its site: 7 s of it); < 5 s with a warm cache; the TENPU overlay test: ~35 s;
# the real-TE tests in the main suite: ~15 min on a loaded machine; the 4-rank Megatron-FSDP-shape
# launches (tests/test_te_megatron_fsdp.py, TE 2.11 and 2.14): 290 s at a load average of ~16
# (107 s CPU); on 2 ranks in the main suite: 262 s (58 s CPU).
# The README test command's .venv (torch 2.13.0 + the test extra) is this step's venv: .ci/run has just
# built it (a venv of its own cost 69 s of the 146 s measured on the CI machine). Run on its own without
# .venv, the step builds .ci/venvs/real-te as that command would.
set -euo pipefail
cd "$(dirname "$0")/../.."
export NPU_FSDP_TESTS_REQUIRE_TE_WHEELS=1
venv=.venv
if [ ! -x "$venv/bin/python" ]; then
    venv=.ci/venvs/real-te
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    "$venv/bin/pip" install -q torch==2.13.0 -e '.[test]'
fi
py=$venv/bin/python
"$py" - <<'PY'
import time
from tests.te_real import RELEASES, TENPU_BASE, te_site, tenpu_site
t0 = time.time()
for v in RELEASES:
    print(v, te_site(v))
print(f"tenpu (from {TENPU_BASE})", tenpu_site())
print(f"real-te: {len(RELEASES) + 1} sites in {time.time() - t0:.0f} s")
PY
"$py" -m pytest -q tests/test_te_cpu_kernels.py tests/test_te_real.py -k "kernels or initialize_state"
"$py" -m pytest -q tests/test_te_fused_adam_patch.py -k overlay
# Megatron-FSDP's shapes on 4 ranks (the README test command runs them on 2): one launch per TE release
NPU_FSDP_PATCHES_MEGATRON_FSDP_WORLDS=4 "$py" -m pytest -q tests/test_te_megatron_fsdp.py
