#!/usr/bin/env bash
# Issue 12: the whole suite again on the older verified torch releases (2.6.0, 2.7.1, 2.10.0); NOT yet run by
# .ci/run (its end-to-end time and its pass on the merged tree are unmeasured): run it by hand. The README
# test command already runs the suite on 2.13.0.
# Per version: a fresh venv .ci/venvs/torch-<v> with the
# registry's torch wheel (a CUDA build: it runs on CPU here, CUDA_VISIBLE_DEVICES="" keeps any GPU out)
# and this package's test extra with pinned deps (.ci/older-torch-constraints.txt), pytest, then the
# venv is deleted (about 5 GB each). Tests needing what a torch lacks (torch.optim.Muon before 2.9,
# Adam(decoupled_weight_decay) before 2.7) skip with the reason; the product's error there is tested.
# Measured (2 cores shared with four other jobs): install 18 min (2.6.0), 31 min (2.7.1), 28 min
# (2.10.0) with cold downloads; the end-to-end time on an idle machine is not measured yet (README).
set -uo pipefail
cd "$(dirname "$0")/../.."

status=0
for version in 2.6.0 2.7.1 2.10.0; do
    venv=".ci/venvs/torch-$version"
    t0=$SECONDS
    rm -rf "$venv"
    python3 -m venv "$venv" \
        && "$venv/bin/pip" install -q -c .ci/older-torch-constraints.txt "torch==$version" -e '.[test]' \
        && "$venv/bin/python" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$version')" \
        && CUDA_VISIBLE_DEVICES="" "$venv/bin/python" -m pytest -q -p no:cacheprovider
    rc=$?
    if [ "$rc" -eq 5 ]; then echo "older-torch: torch $version: pytest collected no tests" >&2; rc=1; fi
    echo "older-torch: torch $version: rc $rc, $((SECONDS - t0)) s"
    rm -rf "$venv"
    [ "$rc" -eq 0 ] || status=1
done
exit "$status"
