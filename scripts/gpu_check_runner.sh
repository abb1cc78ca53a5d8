# shellcheck shell=bash
# The GPU check's step runner, sourced by scripts/gpu_check.sh (and by its tests, to run one
# step under the very same limits).
#
# Each step runs in its own process under `timeout`, within what is left of the whole budget
# (GPU_CHECK_BUDGET_S less RESERVE_S kept for the summary); a step that does not get MIN_STEP_S
# is skipped. `timeout` sends SIGINT, not SIGTERM: pytest then still writes its JUnit file and
# a Python step stops with KeyboardInterrupt, its finished records already appended;
# KILL_AFTER_S later it sends SIGKILL. A step's exit goes to results.jsonl as
# {"step", "record": "exit", "status": ok|failed|timed_out|skipped, "exit_code", "seconds",
# "limit_s"}. A signal to the script stops the step in flight the same way (SIGINT to it) and
# records it, then exits, so the EXIT trap's summary still runs.
#
# Needs: OUTDIR set and `runner_init` called once.

KILL_AFTER_S=${KILL_AFTER_S:-10}
MIN_STEP_S=${MIN_STEP_S:-5}
FAILED_STEPS=()
STEP_PID=
STEP_NAME=
STEP_START=0
STEP_LIMIT=0

# runner_init BUDGET_S RESERVE_S: the log, the results file and the signal traps.
runner_init() {
    BUDGET_S=$1
    RESERVE_S=$2
    LOG="$OUTDIR/gpu_check.log"
    RESULTS="$OUTDIR/results.jsonl"
    touch "$LOG" "$RESULTS"
    trap 'on_signal INT' INT
    trap 'on_signal TERM' TERM
}

log() {
    echo "$*" | tee -a "$LOG"
}

# record_exit NAME EXIT_CODE SECONDS LIMIT [STATUS]: one exit record; EXIT_CODE "" means
# skipped; STATUS, if given, overrides the one the exit code says.
record_exit() {
    local name=$1 code=$2 seconds=$3 limit=$4 status=${5:-}
    if [[ -z $status ]]; then
        case $code in
            "") status=skipped ;;
            0) status=ok ;;
            124 | 137) status=timed_out ;;
            *) status=failed ;;
        esac
    fi
    if [[ $status != ok ]]; then
        FAILED_STEPS+=("$name")
    fi
    printf '{"step": "%s", "record": "exit", "status": "%s", "exit_code": %s, "seconds": %d, "limit_s": %d}\n' \
        "$name" "$status" "${code:-null}" "$seconds" "$limit" >>"$RESULTS"
    log "=== $name: $status${code:+ (exit $code)} after ${seconds}s"
}

# run_step NAME LIMIT_S COMMAND...: COMMAND under the smaller of LIMIT_S and what the budget
# has left (skipped if that is under MIN_STEP_S).
run_step() {
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET_S - RESERVE_S - SECONDS))
    if ((left < limit)); then
        limit=$left
    fi
    if ((limit < MIN_STEP_S)); then
        log "=== $name: skipped, ${left}s of the budget left (it needs ${MIN_STEP_S}s)"
        record_exit "$name" "" 0 0
        return
    fi
    run_limited "$name" "$limit" "$@"
}

# run_limited NAME LIMIT_S COMMAND...: COMMAND under `timeout` (SIGINT, then SIGKILL), its
# output into the log. In the background with `wait`, so a signal to the script is handled
# at once (on_signal) rather than after the step.
run_limited() {
    local name=$1 limit=$2
    shift 2
    log "=== $name (limit ${limit}s): $*"
    STEP_NAME=$name STEP_START=$SECONDS STEP_LIMIT=$limit
    timeout -s INT --kill-after="$KILL_AFTER_S" "$limit" "$@" > >(tee -a "$LOG") 2>&1 &
    STEP_PID=$!
    local code=0
    wait "$STEP_PID" || code=$?
    STEP_PID=
    record_exit "$name" "$code" $((SECONDS - STEP_START)) "$limit"
}

# on_signal NAME: stop the step in flight as its limit would, record it, and exit (the EXIT
# trap then runs).
on_signal() {
    log "=== gpu_check: SIG$1 received"
    if [[ -n $STEP_PID ]]; then
        kill -INT "$STEP_PID" 2>/dev/null
        local code=0
        wait "$STEP_PID" || code=$?
        STEP_PID=
        record_exit "$STEP_NAME" "$code" $((SECONDS - STEP_START)) "$STEP_LIMIT" interrupted
    fi
    exit 130
}
