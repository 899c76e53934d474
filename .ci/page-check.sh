#!/usr/bin/env bash
# Run a stack page's own commands as written (issue 41): `.ci/page-check.sh PAGE VENV [install|check|both]`.
# install: in VENV (created when missing), activated, from the repository root, the page's "## Install"
# bash block, line by line as a newcomer pastes it (bash -e: the first failing command fails it);
# check: the page's "## Check" bash block, whose output must contain every line of the page's "## Check"
# text block (what the page says it prints when it works). .ci/page_blocks.py extracts the blocks, so the
# page and CI cannot drift. Extra environment for the check (a stand-in on PYTHONPATH where the page's
# source cannot be fetched in CI) comes from the caller.
set -uo pipefail
cd "$(dirname "$0")/.."
page=$1 venv=$2 what=${3:-both}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv" || exit 1
# shellcheck disable=SC1091
. "$venv/bin/activate"
if [ "$what" != check ]; then
    echo "page-check: $page: install block:"; python3 .ci/page_blocks.py "$page" install | sed 's/^/    /'
    bash -euo pipefail -c "$(python3 .ci/page_blocks.py "$page" install)" \
        || { echo "page-check: $page: its install block failed" >&2; exit 1; }
fi
[ "$what" = install ] && exit 0
out=$(mktemp)
echo "page-check: $page: check block:"; python3 .ci/page_blocks.py "$page" check | sed 's/^/    /'
bash -euo pipefail -c "$(python3 .ci/page_blocks.py "$page" check)" > "$out" 2>&1
rc=$?
missing=0
while IFS= read -r line; do
    [ -z "${line// }" ] && continue
    grep -qF -- "$line" "$out" || { echo "page-check: $page: the page says it prints, but it did not: $line" >&2; missing=1; }
done < <(python3 .ci/page_blocks.py "$page" expect)
if [ $rc -ne 0 ] || [ $missing -ne 0 ]; then
    echo "page-check: $page: check block rc $rc; its output:" >&2; tail -60 "$out" >&2
    rm -f "$out"; exit 1
fi
rm -f "$out"
echo "page-check: $page: install and check as written: ok"
