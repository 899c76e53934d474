#!/usr/bin/env bash
# Issues 12 and 22: every verified torch besides the README's 2.13.0 (compat_matrix.yaml defaults.verified,
# read by .ci/older-torch.env) runs the torch-sensitive tests, installed from the registry (the CUDA wheel,
# run on CPU with CUDA_VISIBLE_DEVICES="").
# FULL_LIST_TORCH (the oldest, 2.7.1, 2.9.1 and the newest) run FULL: every npu_fsdp_patches.optim path and
# its layout tests, the four torch-facing patches, Megatron's initialize_state path, the real-TE launches
# that back the TE patches' verified torch (TE 2.10.0: te_fused_adam_dtensor +
# te_multi_tensor_apply_empty_tail; TE 2.14.0: te_multi_tensor_apply_empty_tail + te_fused_adam_empty_scale +
# te_fused_adam_empty_group_step, whose cases run in the same launch),
# the FSDP2 examples, the self-test's checks on 2 CPU ranks, the torch autoload entry, the torch gate and
# doctor's torch finding. The others run LEAN: the same coverage less the repeated launches (the examples,
# FusedAdam's and main params' extra multi-rank launches, TE's CPU kernels, Megatron's path). FULL also runs
# the generated cases (Hypothesis, issue 29): on the minors where torch's optimizers change, not on each
# (CI time). EDGE_TORCH (the oldest and the newest) add the COMPILED list.
# The plugin-core, doctor, CLI and packaging files do not depend on the torch release and run on 2.13.0
# only, except the checkpoint command, which reads DCP's metadata types (FULL; its released-layout
# fixtures load on LEAN); .ci/extra/older-torch.sh runs the whole suite on each older torch by hand.
# Per version: wait for .ci/older-torch-wheels.sh (started in the background by .ci/run; run here in the
# foreground when the step runs on its own), install the registry's wheels offline into .ci/venvs/torch-<v>
# (a torch above the pip cap is installed there by that script, in its one registry call), run pytest,
# delete the venv and the wheels (about 5 GB + 3.7 GB). Skips name what the torch lacks (Muon before 2.9,
# Adam(decoupled_weight_decay) and FSDP2 training on CPU before 2.7). Measured times: docs/ci.md.
# Under .ci/run the first version installs in the background during the README test command
# (`prepare`, .ci/prepare.sh; 126 s on the CI machine); each version's times go into .ci/run's table.
# Usage: bash .ci/steps/60-older-torch.sh [VERSION...]   (default: $OLDER_TORCH_VERSIONS)
# prepare: the first version's venv (.ci/prepare.sh runs `bash .ci/steps/60-older-torch.sh prepare`)
set -uo pipefail
cd "$(dirname "$0")/../.."
. .ci/older-torch.env || exit 1
. .ci/prepare.env || exit 1
export NPU_FSDP_TESTS_REQUIRE_TE_WHEELS=1 CUDA_VISIBLE_DEVICES=""
LEAN=(
    tests/test_foreach_adamw.py tests/test_foreach_adamw_contract.py tests/test_fused_adam.py
    tests/test_layouts.py tests/test_main_params.py tests/test_main_params_optimizer_contract.py
    tests/test_main_params_model_writes.py tests/test_main_params_zero_grad.py tests/test_main_params_grad_scaler.py
    tests/test_main_params_hyper.py tests/test_main_params_acceptance.py
    tests/test_hp_skip_dispatch_patch.py tests/test_hp_fp32_main_params_patch.py
    tests/test_te_fused_adam_patch.py tests/test_main_params_veomni_checkpointer.py
    "tests/test_te_real.py::test_real_te_release_on_two_ranks[2.10.0]"
    "tests/test_te_real.py::test_real_te_release_on_two_ranks[2.14.0]"
    # the same 2.14.0 launch: te_fused_adam_empty_group_step's resume and te_fused_adam_empty_scale's FP8 cases
    "tests/test_te_real.py::test_empty_group_counters_resume_like_a_one_rank_run[2.14.0]"
    "tests/test_te_real.py::test_empty_group_counters_fail_on_te_s_own_code_before_2_19[2.14.0]"
    "tests/test_te_real.py::test_fp8_moments_of_an_expert_without_tokens_stay_finite[2.14.0]"
    "tests/test_te_real.py::test_fp8_states_are_scaled_bit_for_bit_as_te_except_all_zero[2.14.0]"
    tests/test_autoload.py tests/test_torch_gate.py tests/test_torch_gate_doctor.py
    "tests/test_self_test_command.py::test_every_applicable_check_passes_in_the_base_env"
    tests/test_checkpoint_layouts.py
)
# LEAN leaves out what does not depend on the torch release: the stand-down probes, the veomni capture
# order, the TENPU overlay's file check, the auto_models trainer path, the unverified-metadata doctor case
# and two of the four autoload launches (each ran on 2.8.0 within the full files); and the main-params
# checkpoints' 2->3->2 resharding launches (two of the acceptance test's three; FULL torches run them).
LEAN_DESELECT=(
    tests/test_hp_skip_dispatch_patch.py::test_stands_down_when_hyper_registers_its_dtensor
    tests/test_hp_skip_dispatch_patch.py::test_veomni_wrap_optimizer_captured_before_apply
    tests/test_hp_fp32_main_params_patch.py::test_stands_down_when_upstream_wrapper_exists
    tests/test_hp_fp32_main_params_patch.py::test_patch_covers_the_older_auto_models_trainer_path
    tests/test_te_fused_adam_patch.py::test_tenpu_stand_in_is_nvte_2_15_under_the_documented_overlay
    tests/test_te_fused_adam_patch.py::test_stands_down_when_the_installed_class_handles_dtensor
    tests/test_torch_gate_doctor.py::test_doctor_warns_when_the_torch_metadata_says_an_unverified_version
    tests/test_autoload.py::test_torch_autoload_kill_switch_is_respected
    tests/test_autoload.py::test_autoload_never_breaks_import_torch_even_when_strict
    tests/test_main_params_acceptance.py::test_checkpoints_reshard_two_to_three_and_back
)
FULL=(
    "${LEAN[@]}" tests/test_foreach_adamw_self_test.py tests/test_fused_adam_multirank.py
    tests/test_main_params_example.py tests/test_example_fsdp2_fused_adam.py
    tests/test_example_fsdp2_vs_foreach_adamw.py tests/test_te_cpu_kernels.py
    tests/test_megatron_initialize_state.py tests/test_generated_cases.py
    tests/test_rebuild_main_params_planner.py
    tests/cli/test_checkpoint_command.py
    tests/test_main_params_torch_code_two_ranks.py
    tests/test_self_test_command.py::test_inside_a_torchrun_job_every_rank_runs_and_rank_0_reports
)

# EDGE_TORCH (the oldest and the newest) add the compiled steps (issue 33; with the README's 2.13.0, three
# verified releases): torch's Adam/AdamW compiled with the plugin on and off, and our optimizers compiled
# against torch's counterparts. Whole files: each starts its launches in module fixtures, so a -k subset
# would save little (measured per torch: docs/ci.md).
COMPILED=(tests/test_compiled_adam.py tests/test_compiled_optimizers.py)

wheels_ready() {  # wheels_ready VERSION: wait for its download (bounded by its timeout); 0 when it succeeded
    local rc_file="$OLDER_TORCH_WHEELS/torch-$1.rc" pid
    pid=$(cat "$OLDER_TORCH_WHEELS/download.pid" 2>/dev/null)
    if [ ! -e "$rc_file" ] && ! alive "$pid"; then
        bash .ci/older-torch-wheels.sh "$1"   # no download running: this step runs on its own
    fi
    while [ ! -e "$rc_file" ]; do
        if ! alive "$pid" && [ ! -e "$rc_file" ]; then
            echo "60-older-torch: the wheel download ended without a result for torch $1" >&2
            return 1
        fi
        sleep 5
    done
    [ "$(cat "$rc_file")" = 0 ] && return 0
    echo "60-older-torch: downloading torch $1's wheels failed (pip rc $(cat "$rc_file"), 124: timed out);" \
         "see $OLDER_TORCH_WHEELS/torch-$1.log and download.log" >&2
    return 1
}

install() {  # install VERSION: its wheels offline into a fresh .ci/venvs/torch-<v>, then delete the wheels
    local venv=.ci/venvs/torch-$1 t0=$SECONDS rc
    if [[ " $ABOVE_PIP_CAP_TORCH " == *" $1 "* ]]; then
        wheels_ready "$1"   # .ci/older-torch-wheels.sh installed it into $venv from the registry
    else
        rm -rf "$venv"
        wheels_ready "$1" \
            && python3 -m venv "$venv" \
            && "$venv/bin/pip" install -q --no-index --find-links "$OLDER_TORCH_WHEELS/torch-$1" \
                -c .ci/older-torch-constraints.txt "torch==$1" -e '.[test]'
    fi \
        && "$venv/bin/python" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$1')"
    rc=$?
    rm -rf "$OLDER_TORCH_WHEELS/torch-$1"
    echo "60-older-torch: torch $1: install took $((SECONDS - t0)) s (rc $rc)"
    echo "$((SECONDS - t0))" > "$OLDER_TORCH_WHEELS/torch-$1.install-s"
    return "$rc"
}

first_install() {  # first_install VERSION...: the first version's install, in the background (sets $pending)
    # .ci/prepare.sh installed the default list's first version while the README test command ran
    if [ $# -eq 0 ] && prepared 60-older-torch; then
        echo "60-older-torch: ${versions[0]} installed in the background ($(grep -h 'install took' \
            "$CI_PREPARED/60-older-torch.log"))"
        true & pending=$!
    else
        install "${versions[0]}" & pending=$!
    fi
}

read -r -a versions <<< "${*:-$OLDER_TORCH_VERSIONS}"
if [ "${1:-}" = prepare ]; then   # .ci/prepare.sh: the first version of the default list only
    read -r -a versions <<< "$OLDER_TORCH_VERSIONS"
    install "${versions[0]}"
    exit
fi
# Each next version installs in the background while the previous one's tests run (disk-bound vs CPU-bound).
first_install "$@"
status=0
for i in "${!versions[@]}"; do
    version=${versions[$i]} venv=.ci/venvs/torch-${versions[$i]}
    wait "$pending"
    rc=$?
    if [ $((i + 1)) -lt "${#versions[@]}" ]; then install "${versions[$((i + 1))]}" & pending=$!; fi
    t1=$SECONDS list=LEAN
    if [ "$rc" -eq 0 ]; then
        tests=("${LEAN[@]}" "${LEAN_DESELECT[@]/#/--deselect=}")
        if [[ " $FULL_LIST_TORCH " == *" $version "* ]]; then list=FULL tests=("${FULL[@]}"); fi
        # the compiled files first: the longest, so that neither worker is left with one at the end
        if [[ " $EDGE_TORCH " == *" $version "* ]]; then list=FULL+COMPILED tests=("${COMPILED[@]}" "${tests[@]}"); fi
        # two pytest workers, a file each (module-scoped launches run once): a launch leaves a core idle
        # while one interpreter imports torch or waits for its peers (measured: LEAN 151 s -> 110 s)
        "$venv/bin/python" -m pytest -q -rs -p no:cacheprovider -n 2 --dist loadfile "${tests[@]}"
        rc=$?
        [ "$rc" -eq 5 ] && { echo "60-older-torch: torch $version: pytest collected no tests" >&2; rc=1; }
        echo "60-older-torch: torch $version: $list list: tests took $((SECONDS - t1)) s (rc $rc)"
    fi
    summary_line "  torch $version: $list tests" $((SECONDS - t1)) \
        "install $(cat "$OLDER_TORCH_WHEELS/torch-$version.install-s" 2>/dev/null || echo '?') s, rc $rc"
    rm -rf "$venv" &   # about 5 GB: deleted while the next version's tests run
    [ "$rc" -eq 0 ] || status=1
done
wait
exit "$status"
