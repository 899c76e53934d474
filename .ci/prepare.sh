#!/usr/bin/env bash
# The steps' set-up in the background (issue 22, CI time): `bash <step> prepare` for each .ci/steps/*.sh that
# has a `# prepare:` header line, in name order, one after another (40-veomni's venv, 50-megatron-py312's
# venv, 60-older-torch's first torch; 30-real-te uses the README test command's .venv). .ci/run starts this script
# in its own process group at t = 0, so the installs (network and disk bound) overlap the main suite (CPU
# bound), and stops the group when it exits. Each step's output goes to $CI_PREPARED/<step>.log and its exit
# code, at the end, to <step>.rc, which the step waits for (`prepared` in .ci/prepare.env).
set -uo pipefail
cd "$(dirname "$0")/.."
. .ci/prepare.env
mkdir -p "$CI_PREPARED"
for step in .ci/steps/*.sh; do
    grep -q '^# prepare:' "$step" || continue
    name=$(basename "$step" .sh) t0=$SECONDS
    bash "$step" prepare > "$CI_PREPARED/$name.log" 2>&1
    rc=$?
    echo "prepare: $name: rc $rc, $((SECONDS - t0)) s"
    [ -s "$CI_PREPARED/$name.log" ] && summary_line "$name: set-up in the background" $((SECONDS - t0)) "rc $rc"
    echo "$rc" > "$CI_PREPARED/$name.rc.tmp" && mv "$CI_PREPARED/$name.rc.tmp" "$CI_PREPARED/$name.rc"
done
