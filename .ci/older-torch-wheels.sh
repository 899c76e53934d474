#!/usr/bin/env bash
# Downloads the registry's wheels of each older verified torch (a CUDA build, about 3 GB with its nvidia-*
# libraries), this package's pinned test deps and its build backend into .ci/venvs/wheels/torch-<v>/, so
# that .ci/steps/60-older-torch.sh installs offline (--no-index). .ci/run starts it in the background
# before the README test command: the downloads are network and disk bound and overlap the main suite.
# Versions are fetched one after another; each ends by writing torch-<v>.rc with pip's exit code (124:
# pip ran past its 25-minute timeout), so the step never waits on a download that cannot finish.
# SIGTERM (sent by .ci/run when it exits) stops the download in progress.
# Usage: bash .ci/older-torch-wheels.sh [VERSION...]   (default: $OLDER_TORCH_VERSIONS of .ci/older-torch.env)
set -uo pipefail
cd "$(dirname "$0")/.."
. .ci/older-torch.env
mkdir -p "$OLDER_TORCH_WHEELS"
for version in ${*:-$OLDER_TORCH_VERSIONS}; do
    t0=$SECONDS
    rm -f "$OLDER_TORCH_WHEELS/torch-$version.rc"
    timeout 1500 python3 -m pip download -q -d "$OLDER_TORCH_WHEELS/torch-$version" \
        -c .ci/older-torch-constraints.txt "torch==$version" '.[test]' 'setuptools>=77' wheel &
    child=$!
    trap 'kill "$child" 2>/dev/null; exit 143' TERM   # .ci/run stopping us stops pip too
    wait "$child"
    rc=$?
    echo "older-torch-wheels: torch $version: rc $rc, $((SECONDS - t0)) s, $(du -sh "$OLDER_TORCH_WHEELS/torch-$version" 2>/dev/null | cut -f1)"
    echo "$rc" > "$OLDER_TORCH_WHEELS/torch-$version.rc.tmp" \
        && mv "$OLDER_TORCH_WHEELS/torch-$version.rc.tmp" "$OLDER_TORCH_WHEELS/torch-$version.rc"
done
