#!/usr/bin/env bash
# torchtitan 0.3.0 as a real client (issue 41): its venv .ci/venvs/torchtitan is built by
# docs/integrations/torchtitan.md's own Install block, run as written (.ci/page-check.sh: page and CI cannot
# drift): torch==2.13.0 (the local CPU wheel) and torchtitan==0.3.0 with its dependencies, then this
# checkout; then the test extra, editable. The step runs the page's Check block (doctor --import, the
# example) and checks the lines the page says it prints, then tests/clients/test_torchtitan.py on 2 gloo
# ranks (the example, its two planted bugs, the planner's refusals through torchtitan's CheckpointManager).
# NPU_FSDP_PATCHES_REQUIRE_TORCHTITAN=1 turns the tests' "torchtitan missing" skip into a failure.
# Uses .ci/page-check.sh and .ci/page_blocks.py (the stack pages' Install/Check runner, issue 41).
# Measured on its own (2 cores shared with other sessions, load average 13-22): install 616 s, the page's
# Check block 33 s, the tests 100 s (docs/ci.md). The install runs in the background while the README test
# command runs (`prepare`, .ci/prepare.sh), so under .ci/run the step costs about 130 s.
# prepare: the venv (.ci/prepare.sh runs `bash .ci/steps/46-torchtitan.sh prepare` in the background)
set -uo pipefail
. .ci/prepare.env || exit 1
venv=.ci/venvs/torchtitan
page=docs/integrations/torchtitan.md

install_venv() {
    local t0=$SECONDS
    rm -rf "$venv"
    bash .ci/page-check.sh "$page" "$venv" install \
      && "$venv/bin/pip" install -q -e '.[test]' \
      || { echo "46-torchtitan: install failed" >&2; return 1; }
    echo "46-torchtitan: install took $((SECONDS - t0)) s"
}

[ "${1:-}" = prepare ] && { install_venv; exit; }
prepared 46-torchtitan
case $? in
    0) echo "46-torchtitan: installed in the background ($(grep -h 'install took' "$CI_PREPARED/46-torchtitan.log"))" ;;
    *) install_venv || exit 1 ;;
esac
t1=$SECONDS
bash .ci/page-check.sh "$page" "$venv" check || exit 1
echo "46-torchtitan: the page's Check block took $((SECONDS - t1)) s"
t1=$SECONDS
NPU_FSDP_PATCHES_REQUIRE_TORCHTITAN=1 "$venv/bin/python" -m pytest tests/clients/test_torchtitan.py -q
rc=$?
echo "46-torchtitan: tests took $((SECONDS - t1)) s"
exit $rc
