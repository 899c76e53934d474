#!/usr/bin/env bash
# veomni 0.1.12 as a real client (issues 9, 19): tests/clients/test_veomni.py on 2 gloo ranks, in the venv
# .ci/venvs/veomni, built by docs/integrations/veomni.md's own Install block, run as written
# (.ci/page-check.sh, issue 41: page and CI cannot drift): veomni==0.1.12 with torch==2.13.0 (the local CPU
# wheel), transformers==5.18.0 without its resolver (5.24 breaks veomni's import), plus the two of its deps
# veomni's import needs (tokenizers, typer); the registry's torchvision (pulled in by timm) is removed
# because it breaks CPU torch. Then the test extra, editable. The step runs the page's Check block too
# (doctor --import, the example) and checks the lines the page says it prints.
# NPU_FSDP_PATCHES_REQUIRE_VEOMNI=1 turns the tests' "veomni missing" skip into a failure.
# Measured on the merged tree (2 cores, lightly loaded): cold venv + install 345 s (1274 s under a load
# average of ~12). Tests: 2 launches (AdamW, Muon), each resuming through save/load_checkpoint and through
# veomni's own DistributedCheckpointer: 143 s at a load average of ~18 (issue 19 branch).
# The install runs in the background while the README test command runs (`prepare`, .ci/prepare.sh); 157 s
# of the step's 213 s on the CI machine were the install.
# prepare: the venv (.ci/prepare.sh runs `bash .ci/steps/40-veomni.sh prepare` in the background)
set -uo pipefail
. .ci/prepare.env || exit 1
venv=.ci/venvs/veomni
page=docs/integrations/veomni.md

install_venv() {
    local t0=$SECONDS
    rm -rf "$venv"
    bash .ci/page-check.sh "$page" "$venv" install \
      && "$venv/bin/pip" install -q -e '.[test]' \
      || { echo "40-veomni: install failed" >&2; return 1; }
    echo "40-veomni: install took $((SECONDS - t0)) s"
}

[ "${1:-}" = prepare ] && { install_venv; exit; }
prepared 40-veomni
case $? in
    0) echo "40-veomni: installed in the background ($(grep -h 'install took' "$CI_PREPARED/40-veomni.log"))" ;;
    *) install_venv || exit 1 ;;
esac
t1=$SECONDS
bash .ci/page-check.sh "$page" "$venv" check || exit 1
echo "40-veomni: the page's Check block took $((SECONDS - t1)) s"
t1=$SECONDS
NPU_FSDP_PATCHES_REQUIRE_VEOMNI=1 "$venv/bin/python" -m pytest tests/clients/test_veomni.py \
    tests/test_example_veomni_main_params.py -q
rc=$?
echo "40-veomni: tests took $((SECONDS - t1)) s"
exit $rc
