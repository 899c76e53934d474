#!/usr/bin/env bash
# The stack pages as a newcomer runs them (issue 41): the "## Install" block of docs/integrations/fsdp2.md,
# megatron_te.md, mindspeed.md and hyper_parallel.md, run as written (.ci/page-check.sh) into one fresh venv
# (.ci/venvs/pages), in that order, then each page's "## Check" block, whose output must hold the lines the
# page says it prints. One venv for the four (each block adds to the one before: torch, numpy and the plugin,
# then megatron-core) keeps CI's time down; each page alone from an empty venv is tried by hand
# (docs/ci.md). veomni.md's blocks run in step 40-veomni, which builds its venv with them. Where a page's
# source cannot be fetched in CI (hyper-parallel's git checkout), its check runs on the new-generation
# stand-in, tests/fixtures/hyper_parallel_new, on PYTHONPATH.
# prepare: the venv (.ci/prepare.sh runs `bash .ci/steps/45-pages.sh prepare` in the background)
set -uo pipefail
cd "$(dirname "$0")/../.."
. .ci/prepare.env || exit 1
venv=.ci/venvs/pages
pages=(docs/integrations/fsdp2.md docs/integrations/megatron_te.md docs/integrations/mindspeed.md
       docs/integrations/hyper_parallel.md)

install_venv() {
    local t0=$SECONDS page
    rm -rf "$venv"
    for page in "${pages[@]}"; do
        bash .ci/page-check.sh "$page" "$venv" install || { echo "45-pages: $page: install failed" >&2; return 1; }
    done
    echo "45-pages: install took $((SECONDS - t0)) s"
}

[ "${1:-}" = prepare ] && { install_venv; exit; }
prepared 45-pages
case $? in
    0) echo "45-pages: installed in the background ($(grep -h 'install took' "$CI_PREPARED/45-pages.log"))" ;;
    *) install_venv || exit 1 ;;
esac
stand_in=$(mktemp -d)
trap 'rm -rf "$stand_in"' EXIT
cp -r tests/fixtures/hyper_parallel_common/. tests/fixtures/hyper_parallel_new/. "$stand_in"/
rm -f "$stand_in/FIXTURE_INCLUDES"
rc=0
for page in "${pages[@]}"; do
    t1=$SECONDS
    if [ "$page" = docs/integrations/hyper_parallel.md ]; then
        PYTHONPATH=$stand_in HYPER_PARALLEL_PLATFORM=torch bash .ci/page-check.sh "$page" "$venv" check || rc=1
    else
        bash .ci/page-check.sh "$page" "$venv" check || rc=1
    fi
    echo "45-pages: $page: check took $((SECONDS - t1)) s"
done
exit $rc
