#!/usr/bin/env bash
# One-call GPU check: validate the Triton kernels and the engine on a GPU, and measure them
# against the machine's own ceilings (docs/gpu.md says what every number means).
#
#   scripts/gpu_check.sh OUTDIR [--smoke]
#
# Runs from a bare checkout with the machine's own python (PYTHON, default python3): no
# install, no network. Wheels in GPU_CHECK_WHEELS (default .whl/, made by `make gpu-wheels`)
# are installed first into a fresh folder put on PYTHONPATH. Steps, in order, each in its own
# process under its own limit (seconds), each one's failure logged and skipped past:
#   env        25  versions, device; read and copy bandwidth, bf16 matmul rate
#   tests     110  kernels, variants, CUDA graphs, KV transfer, quant, pinned -> gpu_tests.xml
#   e2e        60  greedy tokens on the GPU vs the CPU, same CPU-drawn weights
#   attention  55  decode kernel vs SDPA, fraction of the read bandwidth
#   engine     85  kvpool on a dummy Llama-3-8B, bf16, batch 1/32/64/256
#   hf         55  transformers `generate`, same weights and batches
#   tp         60  with >= 2 GPUs only: `kvpool bench tp`               -> tp.json
#   summary    20  on exit, whatever happened: the targets checked      -> gpu_check.json
# Python steps append their measurements to OUTDIR/results.jsonl as they finish; everything
# printed goes to OUTDIR/gpu_check.log. The steps stay within GPU_CHECK_BUDGET_S (default 420)
# in all, the summary's 20 s included: a step gets the smaller of its limit and what is left.
# Exit status 0 only if every step ran and passed.
# --smoke: the same steps with tiny shapes on any device, the CPU included (CI runs it).
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
# shellcheck source=scripts/gpu_check_runner.sh
source scripts/gpu_check_runner.sh

PYTHON=${PYTHON:-python3}
SUMMARY_LIMIT_S=20
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
runner_init "${GPU_CHECK_BUDGET_S:-420}" "$SUMMARY_LIMIT_S"

python_step() {
    local name=$1 limit=$2
    run_step "$name" "$limit" "$PYTHON" -m benchmarks.gpu_check "$name" --out "$OUTDIR" \
        ${smoke_args[@]+"${smoke_args[@]}"}
}

# The wheels of what the machine's image lacks, into a fresh folder (never over its own),
# removed on exit.
WHEEL_SITE=
install_wheels() {
    local wheels=${GPU_CHECK_WHEELS:-.whl}
    if ! compgen -G "$wheels/*.whl" >/dev/null; then
        log "=== wheels: none in $wheels"
        return
    fi
    WHEEL_SITE=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_site.XXXXXX")
    run_limited wheels 60 "$PYTHON" -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --target "$WHEEL_SITE" "$wheels"/*.whl
    if [[ ${FAILED_STEPS[*]} != *wheels* ]]; then
        export PYTHONPATH="$PYTHONPATH:$WHEEL_SITE"
    fi
}

# The kernel tests against the torch reference (float, int8, fp8; GQA; block sizes), no kernel
# variant compiled after the warm-up, decode CUDA graphs against eager, the KV tiers' copies,
# the quantized-KV reference and the exactly sized pinned host memory; a smoke run only the last (the kernels run in
# Triton's interpreter in CI's own test run).
tests_step() {
    local args=(-m pytest -q -p no:cacheprovider --junitxml="$OUTDIR/gpu_tests.xml")
    if [[ ${#smoke_args[@]} -gt 0 ]]; then
        args+=(tests/memory/test_kv_quant.py)
    else
        args+=(tests/attention/test_triton_kernels.py tests/attention/test_triton_variants.py
               tests/engine/test_decode_graphs.py tests/memory/test_kv_transfer.py
               tests/memory/test_kv_quant.py tests/memory/test_pinned.py)
        if "$PYTHON" -c "import xdist" 2>/dev/null; then
            args+=(-n 12)  # kernel compilation dominates: spread it over the CPU cores
        fi
    fi
    run_step tests "$1" "$PYTHON" "${args[@]}"
}

# Tensor parallelism (docs/parallel.md) needs two GPUs; with fewer the step is skipped.
tp_step() {
    local num_gpus=0
    if command -v nvidia-smi >/dev/null; then
        num_gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
    fi
    if [[ $num_gpus -lt 2 ]]; then
        log "=== tp: not run, $num_gpus GPU(s) visible (tensor parallelism needs 2)"
        return
    fi
    local args=(bench tp -tp 2 --device cuda --model qwen2-0.5b --load-format dummy
        --dtype float32 --num-prompts 8 --input-len 64 --output-len 32 --rounds 2
        --output-json "$OUTDIR/tp.json")
    if [[ ${#smoke_args[@]} -gt 0 ]]; then
        args+=(--num-prompts 2 --output-len 4 --rounds 1)
    fi
    run_step tp "$1" "$PYTHON" -m kvpool "${args[@]}"
}

# On exit, whatever happened: the summary from whatever results exist, and the exit status.
finish() {
    trap - EXIT
    run_limited summary "$SUMMARY_LIMIT_S" "$PYTHON" -m benchmarks.gpu_check summary \
        --out "$OUTDIR" ${smoke_args[@]+"${smoke_args[@]}"}
    log "gpu_check: done in ${SECONDS}s, ${#FAILED_STEPS[@]} step(s) not ok" \
        "${FAILED_STEPS[*]}; results in $OUTDIR"
    if [[ -n $WHEEL_SITE ]]; then
        rm -rf "$WHEEL_SITE"
    fi
    if [[ ${#FAILED_STEPS[@]} -gt 0 ]]; then
        exit 1
    fi
    exit 0
}
trap finish EXIT

log "gpu_check: $(date -u +%Y-%m-%dT%H:%M:%SZ) in $(pwd), python: $(command -v "$PYTHON")," \
    "budget ${BUDGET_S}s"
if command -v nvidia-smi >/dev/null; then
    nvidia-smi 2>&1 | tee -a "$LOG"
fi
install_wheels
python_step env 25
tests_step 110
python_step e2e 60
python_step attention 55
python_step engine 85
python_step hf 55
tp_step 60
