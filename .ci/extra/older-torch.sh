#!/usr/bin/env bash
# Issue 12, by hand (not part of .ci/run): the WHOLE suite on each older verified torch (.ci/older-torch.env:
# every verified torch of compat_matrix.yaml but 2.13.0). CI's .ci/steps/60-older-torch.sh runs only the
# torch-sensitive files there; this script is the full check behind it. Per version: download the registry's wheels
# (.ci/older-torch-wheels.sh: the CUDA build, run on CPU with CUDA_VISIBLE_DEVICES="", and the pinned test
# deps of .ci/older-torch-constraints.txt), install them offline into .ci/venvs/torch-<v>, run pytest,
# delete the venv and the wheels (about 5 GB + 3 GB). Tests needing what a torch lacks skip with the
# reason (pytest -rs); the product's error there is tested. Measured figures: docs/ci.md.
set -uo pipefail
cd "$(dirname "$0")/../.."
. .ci/older-torch.env || exit 1
export CUDA_VISIBLE_DEVICES=""

status=0
for version in ${*:-$OLDER_TORCH_VERSIONS}; do
    venv=.ci/venvs/torch-$version wheels=$OLDER_TORCH_WHEELS/torch-$version
    t0=$SECONDS
    rm -rf "$venv"
    bash .ci/older-torch-wheels.sh "$version" \
        && [ "$(cat "$OLDER_TORCH_WHEELS/torch-$version.rc")" = 0 ] \
        && if [[ " $ABOVE_PIP_CAP_TORCH " != *" $version "* ]]; then   # else installed by the line above
            python3 -m venv "$venv" \
            && "$venv/bin/pip" install -q --no-index --find-links "$wheels" -c .ci/older-torch-constraints.txt \
                "torch==$version" -e '.[test]'
        fi \
        && "$venv/bin/python" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$version')" \
        && echo "older-torch: torch $version: download and install took $((SECONDS - t0)) s" \
        && "$venv/bin/python" -m pytest -q -rs -p no:cacheprovider
    rc=$?
    if [ "$rc" -eq 5 ]; then echo "older-torch: torch $version: pytest collected no tests" >&2; rc=1; fi
    echo "older-torch: torch $version: rc $rc, $((SECONDS - t0)) s in all"
    rm -rf "$venv" "$wheels"
    [ "$rc" -eq 0 ] || status=1
done
exit "$status"
