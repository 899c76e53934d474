#!/usr/bin/env bash
# One prepared run on an accelerator (docs/performance.md#the-prepared-device-run):
#
#     bash benchmarks/device_run.sh cuda|npu|cpu [--quick]
#
# Runs the self-test, every example under examples/ and the step benchmarks on the given device with its
# backend (nccl for cuda, hccl for npu, gloo for cpu), one after another, each under its own timeout and
# all within a budget of 8 minutes (DEVICE_RUN_BUDGET_S, default 470 s). One failure never stops the run.
# Everything goes to ONE results file, $OUT/device_run_<device>.txt when OUT is set, else
# results/device_run_<device>.txt; the summary at its end (also printed) names what could not run and why.
# --quick (or DEVICE_RUN_QUICK=1) is the smoke run CI does on cpu: the self-test's adamw_step check, two
# examples (one whose framework is absent, to exercise the failure path), the compiled-step benchmark and
# the main-params step benchmark (ranks on the device's backend) at tiny sizes; the rest is listed as skipped.
# An item that cannot run here (an example whose framework or device is missing says "<script> needs ...")
# is listed as NOT RUN with that line and does not fail the run.
# Exit status: 0 when everything that ran passed, 1 otherwise, 2 on a usage error.
set -u

device="${1:-}"
quick="${DEVICE_RUN_QUICK:-0}"
[ "${2:-}" = "--quick" ] && quick=1
case "$device" in
    cuda) backend=nccl ;;
    npu) backend=hccl ;;
    cpu) backend=gloo ;;
    *) echo "usage: bash benchmarks/device_run.sh cuda|npu|cpu [--quick]" >&2; exit 2 ;;
esac

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo" || exit 2
python="${PYTHON:-python}"
[ -x "$repo/.venv/bin/python" ] && [ -z "${PYTHON:-}" ] && python="$repo/.venv/bin/python"
out_dir="${OUT:-$repo/results}"
mkdir -p "$out_dir"
results="$out_dir/device_run_${device}.txt"
budget="${DEVICE_RUN_BUDGET_S:-470}"
start=$(date +%s)
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
summary=()
failed=0
item_log="$(mktemp)"
trap 'rm -f "$item_log"' EXIT

# ranks: 2 on cpu; on an accelerator one per device, at most 2 (the examples' shape), at least 1
if [ "$device" = cpu ]; then
    nproc=2
else
    nproc=$("$python" - "$device" <<'EOF' 2>/dev/null || echo 0
import sys
import torch
if sys.argv[1] == "npu":
    import torch_npu  # noqa: F401
print(min(2, getattr(torch, sys.argv[1]).device_count()))
EOF
)
    [ "$nproc" -ge 1 ] 2>/dev/null || nproc=0
fi

{
    echo "device_run: device=$device backend=$backend ranks=$nproc quick=$quick budget=${budget}s"
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)  host: $(uname -n)"
    "$python" -c "import torch, npu_fsdp_patches as p; print('torch', torch.__version__, '| npu_fsdp_patches', getattr(p, '__version__', '?'))" 2>&1
    [ "$device" = cuda ] && command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    [ "$device" = npu ] && command -v npu-smi >/dev/null && npu-smi info 2>&1 | head -n 12
} >"$results" 2>&1
cat "$results"

# run NAME CAP_SECONDS CMD...: one item, bounded by its cap and by what is left of the budget
run() {
    local name="$1" cap="$2" left rc t0 t1
    shift 2
    left=$(( budget - ($(date +%s) - start) ))
    if [ "$left" -lt 15 ]; then
        summary+=("NOT RUN   $name: the ${budget}s budget is spent")
        failed=1
        return
    fi
    [ "$cap" -gt "$left" ] && cap=$left
    echo "=== $name (timeout ${cap}s): $*" | tee -a "$results"
    t0=$(date +%s)
    timeout --kill-after=10 "$cap" "$@" >"$item_log" 2>&1
    rc=$?
    t1=$(date +%s)
    cat "$item_log" >>"$results"
    # an example that lacks its framework or device says so in one line "<script> needs ..." (exit 2)
    needs=$(grep -m1 -E "^[A-Za-z0-9_]+\.py( --device [a-z]+)? needs " "$item_log" | cut -c1-240)
    if [ "$rc" -ne 0 ] && [ -n "$needs" ]; then
        summary+=("NOT RUN   $name: $needs")
    elif [ "$rc" -eq 0 ]; then
        summary+=("ok        $name ($((t1 - t0))s)")
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        summary+=("TIMEOUT   $name after $((t1 - t0))s (cap ${cap}s)")
        failed=1
    else
        summary+=("FAILED    $name: rc $rc after $((t1 - t0))s (see its section above)")
        failed=1
    fi
    echo "=== $name: rc $rc, $((t1 - t0))s" | tee -a "$results"
}

skip() { summary+=("skipped   $1: $2"); }

torchrun=("$python" -m torch.distributed.run --standalone "--nproc_per_node=$nproc")

# 1. the self-test
if [ "$nproc" -lt 1 ]; then
    skip "self-test" "no $device device visible"
elif [ "$quick" = 1 ]; then
    run "self-test (adamw_step)" 120 "$python" -m npu_fsdp_patches self-test --device "$device" \
        --backend "$backend" --nproc-per-node "$nproc" --only adamw_step --timeout 110
else
    run "self-test" 200 "$python" -m npu_fsdp_patches self-test --device "$device" --backend "$backend" \
        --nproc-per-node "$nproc" --timeout 190
fi

# 2. every example (device_setup.py is their shared helper, not an example)
quick_examples=" fsdp2_vs_foreach_adamw.py megatron_te_fused_adam.py "
for script in examples/*.py; do
    name="$(basename "$script")"
    [ "$name" = device_setup.py ] && continue
    if [ "$quick" = 1 ] && [[ "$quick_examples" != *" $name "* ]]; then
        skip "example $name" "--quick"
    elif [ "$nproc" -lt 1 ]; then
        skip "example $name" "no $device device visible"
    else
        ckpt="$(mktemp -d)"
        case "$name" in
            fsdp2_fused_adam.py|fsdp2_main_params_muon.py|veomni_main_params.py)
                run "example $name" 90 "${torchrun[@]}" "$script" --device "$device" --ckpt "$ckpt" ;;
            *)
                run "example $name" 90 "${torchrun[@]}" "$script" --device "$device" ;;
        esac
        rm -rf "$ckpt"
    fi
done

# 3. the step benchmarks
run "benchmark compiled_step.py" 150 "$python" benchmarks/compiled_step.py --device "$device" \
    $([ "$quick" = 1 ] && echo --quick)
# the rank-launching ones on the device's backend, one rank per device (at most 2; 2 gloo ranks on cpu)
for bench in main_params_step.py fused_adam_step.py foreach_adamw_step.py foreach_adamw_overhead.py; do
    on=(--device "$device")
    [ "$device" != cpu ] && on+=(--world "$nproc")
    if [ "$quick" = 1 ] && [ "$bench" = main_params_step.py ]; then   # the launcher's path, tiny
        run "benchmark $bench" 90 "$python" "benchmarks/$bench" "${on[@]}" --steps 2 --warmup 1 --params 2 \
            --rows 64 --cols 32 --backend aot_eager
    elif [ "$quick" = 1 ]; then
        skip "benchmark $bench" "--quick"
    elif [ "$nproc" -lt 1 ]; then
        skip "benchmark $bench" "no $device device visible"
    else
        case "$bench" in
            foreach_adamw_overhead.py) run "benchmark $bench" 90 "$python" "benchmarks/$bench" --device "$device" \
                --repeats 5 ;;
            main_params_step.py) run "benchmark $bench" 150 "$python" "benchmarks/$bench" "${on[@]}" --steps 10 ;;
            *) run "benchmark $bench" 90 "$python" "benchmarks/$bench" "${on[@]}" --repeats 10 ;;
        esac
    fi
done

{
    echo
    echo "=== summary: $device, $(( $(date +%s) - start ))s of the ${budget}s budget"
    printf '%s\n' "${summary[@]}"
    if [ "$failed" = 1 ]; then
        echo "failed (see above): every FAILED or TIMEOUT line, and NOT RUN where the budget was spent"
    else
        echo "everything that ran passed; NOT RUN lines name what this machine lacks"
    fi
    echo "results file: $results"
} | tee -a "$results"
exit "$failed"
