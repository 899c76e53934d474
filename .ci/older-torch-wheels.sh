#!/usr/bin/env bash
# Downloads the registry's wheels of each older verified torch (a CUDA build, about 3.7 GB with its nvidia-*
# libraries), this package's pinned test deps and its build backend into .ci/venvs/wheels/torch-<v>/, so
# that .ci/steps/60-older-torch.sh installs offline (--no-index). .ci/run starts it in the background
# before the README test command: the downloads are network and disk bound and overlap the main suite.
# A torch above the pip cap of the machine's global pip configuration ($ABOVE_PIP_CAP_TORCH) is instead
# installed straight into .ci/venvs/torch-<v> by one pip call that ignores that configuration
# (PIP_CONFIG_FILE=/dev/null; also its local wheel folder and extra indexes): the only such call.
# Versions are fetched one after another, pip's output in torch-<v>.log; each ends by writing torch-<v>.rc
# with pip's exit code (124: pip ran past its timeout, 25 minutes for a download, 40 for the above-cap
# install, which downloads and installs), so the step never waits on a download that cannot finish.
# SIGTERM (sent by .ci/run when it exits) stops the download in progress.
# Usage: bash .ci/older-torch-wheels.sh [VERSION...]   (default: $OLDER_TORCH_VERSIONS of .ci/older-torch.env)
set -uo pipefail
cd "$(dirname "$0")/../"
. .ci/older-torch.env || exit 1

keep_used() {  # keep_used DIR LOG: delete the files of DIR that pip's LOG neither saved nor found already there
    local used
    used=$(grep -oE '(File was already downloaded|Saved) [^ ]+' "$2" | sed 's|.*[ /]||' | sort -u)
    grep -qx "torch-${version}-.*\.whl" <<< "$used" || return 0   # unexpected log: keep everything
    for file in "$1"/*; do
        grep -qxF "${file##*/}" <<< "$used" || rm -f "$file"
    done
}

mkdir -p "$OLDER_TORCH_WHEELS"
previous=
for version in ${*:-$OLDER_TORCH_VERSIONS}; do
    t0=$SECONDS dest=$OLDER_TORCH_WHEELS/torch-$version log=$OLDER_TORCH_WHEELS/torch-$version.log
    rm -f "$OLDER_TORCH_WHEELS/torch-$version.rc"
    if [[ " $ABOVE_PIP_CAP_TORCH " == *" $version "* ]]; then
        dest=.ci/venvs/torch-$version
        rm -rf "$dest" && python3 -m venv "$dest"
        PIP_CONFIG_FILE=/dev/null timeout 2400 "$dest/bin/pip" install -q -c .ci/older-torch-constraints.txt \
            "torch==$version" -e '.[test]' > "$log" 2>&1 &
    else
        # The previous version's wheels, hard-linked in first: pip download skips a file already in $dest,
        # so the nvidia-* libraries two torch releases share are fetched once (one that step 60 deleted
        # meanwhile is simply fetched). Afterwards only what pip reported using stays.
        mkdir -p "$dest" && [ -n "$previous" ] && cp -al "$previous/." "$dest/" 2>/dev/null
        timeout 1500 python3 -m pip download -d "$dest" -c .ci/older-torch-constraints.txt \
            "torch==$version" '.[test]' 'setuptools>=77' wheel > "$log" 2>&1 &
    fi
    child=$!
    trap 'kill "$child" 2>/dev/null; exit 143' TERM   # .ci/run stopping us stops pip too
    wait "$child"
    rc=$?
    [ "$rc" -eq 0 ] && [ -d "$OLDER_TORCH_WHEELS/torch-$version" ] && keep_used "$dest" "$log"
    echo "older-torch-wheels: torch $version: rc $rc, $((SECONDS - t0)) s, $(du -sh "$dest" 2>/dev/null | cut -f1) in $dest"
    [ -d "$OLDER_TORCH_WHEELS/torch-$version" ] && previous=$OLDER_TORCH_WHEELS/torch-$version
    echo "$rc" > "$OLDER_TORCH_WHEELS/torch-$version.rc.tmp" \
        && mv "$OLDER_TORCH_WHEELS/torch-$version.rc.tmp" "$OLDER_TORCH_WHEELS/torch-$version.rc"
done
