#!/usr/bin/env bash
# One-call GPU check: validate the Triton kernels and measure them against the bandwidth limit.
#
#   scripts/gpu_check.sh OUTDIR [--smoke]
#
# Runs from a bare checkout with the machine's own python (PYTHON, default python3): no install,
# no network. Steps, each in its own process under its own time limit, each one's failure
# logged without stopping the rest (docs/gpu.md explains every number):
#   bandwidth  device facts and copy bandwidth          -> OUTDIR/bandwidth.json
#   attention  decode kernel vs SDPA, 4 batches x 3 ctx  -> OUTDIR/attention.json
#   engine     kvpool end to end, Llama-3-8B dummy bf16  -> OUTDIR/engine.json
#   hf         transformers generate, same weights       -> OUTDIR/hf.json
#   tp         with >= 2 GPUs only, over NCCL: collectives per step against their formula, and
#              greedy tp=2 vs tp=1 token identity for real weights (`kvpool bench tp`; with
#              dummy weights, drawn per rank, tokens are not compared) -> OUTDIR/tp.json
#   tests      the kernel and KV-transfer tests, GPU-marked too -> OUTDIR/gpu_tests.xml
#   summary    the targets checked                        -> OUTDIR/gpu_check.json
# and the log in OUTDIR/gpu_check.log. The whole run stays within GPU_CHECK_BUDGET_S seconds
# (default 285): the tests, run last, get whatever the benchmarks left.
# --smoke: tiny shapes on any device and the tests only collected (the CPU test uses it).
set -uo pipefail

if [[ $# -lt 1 || $# -gt 2 || ($# -eq 2 && $2 != "--smoke") ]]; then
    echo "usage: $0 OUTDIR [--smoke]" >&2
    exit 2
fi
mkdir -p "$1"
OUTDIR=$(cd "$1" && pwd)
smoke_args=()
if [[ $# -eq 2 ]]; then
    smoke_args=(--smoke)
fi
cd "$(dirname "$0")/.." || exit 2

PYTHON=${PYTHON:-python3}
LOG="$OUTDIR/gpu_check.log"
STEPS_FILE="$OUTDIR/steps.tsv"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
: >"$LOG"
printf 'step\texit_code\tseconds\n' >"$STEPS_FILE"

log() {
    echo "$*" | tee -a "$LOG"
}

# run_step NAME LIMIT_SECONDS COMMAND...: run it under `timeout`, log its output and its status.
run_step() {
    local name=$1 limit=$2
    shift 2
    log "=== $name (limit ${limit}s): $*"
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
    local status=${PIPESTATUS[0]}
    local elapsed=$((SECONDS - start))
    printf '%s\t%s\t%s\n' "$name" "$status" "$elapsed" >>"$STEPS_FILE"
    if [[ $status -eq 124 || $status -eq 137 ]]; then
        log "=== $name: TIMED OUT after ${elapsed}s"
    else
        log "=== $name: exit $status after ${elapsed}s"
    fi
}

python_step() {
    local name=$1 limit=$2
    run_step "$name" "$limit" "$PYTHON" -m benchmarks.gpu_check "$name" --out "$OUTDIR" \
        ${smoke_args[@]+"${smoke_args[@]}"}
}

log "gpu_check: $(date -u +%Y-%m-%dT%H:%M:%SZ) in $(pwd), python: $(command -v "$PYTHON")"
if command -v nvidia-smi >/dev/null; then
    nvidia-smi 2>&1 | tee -a "$LOG"
fi

python_step bandwidth 25
python_step attention 60
python_step engine 55
python_step hf 45

# Tensor parallelism (docs/parallel.md) needs two GPUs; with fewer the step is skipped, not failed.
num_gpus=0
if command -v nvidia-smi >/dev/null; then
    num_gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
fi
if [[ $num_gpus -ge 2 ]]; then
    tp_args=(bench tp -tp 2 --device cuda --model qwen2-0.5b --load-format dummy --dtype float32
        --num-prompts 8 --input-len 64 --output-len 32 --rounds 2 --output-json "$OUTDIR/tp.json")
    if [[ ${#smoke_args[@]} -gt 0 ]]; then
        tp_args+=(--num-prompts 2 --output-len 4 --rounds 1)
    fi
    run_step tp 60 "$PYTHON" -m kvpool "${tp_args[@]}"
else
    log "=== tp: skipped, $num_gpus GPU(s) visible (tensor parallelism needs 2)"
fi

pytest_args=(-q -p no:cacheprovider tests/attention/test_triton_kernels.py tests/memory/test_kv_transfer.py
             tests/memory/test_kv_quant.py)
pytest_args+=(--junitxml="$OUTDIR/gpu_tests.xml")
if [[ ${#smoke_args[@]} -gt 0 ]]; then
    pytest_args+=(--collect-only)
elif "$PYTHON" -c "import xdist" 2>/dev/null; then
    pytest_args+=(-n 12)  # kernel compilation dominates: spread it over the CPU cores
fi
tests_limit=$((${GPU_CHECK_BUDGET_S:-285} - SECONDS - 10))
run_step tests $((tests_limit > 30 ? tests_limit : 30)) "$PYTHON" -m pytest "${pytest_args[@]}"

python_step summary 10
num_failed=$(awk -F'\t' 'NR > 1 && $2 != 0' "$STEPS_FILE" | wc -l)
log "gpu_check: done in ${SECONDS}s, $num_failed step(s) failed; results in $OUTDIR"
[[ $num_failed -eq 0 ]]
