#!/usr/bin/env bash
# bench/gpu_check.sh: one shot on a lent GPU machine (one H200, no network, a few
# minutes, only $OUT and the output's last 12,000 characters come back).
#
#   bash bench/gpu_check.sh                  # from anywhere; on the GPU machine
#   bash bench/gpu_check.sh --save-results   # also write bench/results/<gpu>-<date>-*.json
#   KVCOPY_DEVICE=cpu OUT=/tmp/r bash bench/gpu_check.sh   # the CPU rehearsal (CI runs it)
#   python bench/gpu_check.py save DIR       # here, from a fetched run's files
#
# Python: $PYTHON, else python3, else python. pip is never run (PIP_NO_INDEX is set in
# case anything does). Every step is its own process under its own `timeout`, and the
# whole stays within GPU_CHECK_TOTAL_S (330 s): a step gets min(its budget, what is left
# less the summary's reserve). Everything is written as it happens to $OUT when set
# (else a temporary folder): gpu_check.log and one JSON per step, checkpointed (8 files,
# the most the device runner returns). Nothing goes to bench/results/ unless
# --save-results (or GPU_CHECK_SAVE=1) asks. The short summary is printed last, and the
# exit status is 1 when a step failed, timed out or did not run. The steps and what
# they record: bench/gpu_check.py. Carry kvcopy/_lib (git-ignored) so the prebuilt
# libraries travel; they are rebuilt (into scratch, never over kvcopy/_lib) only when
# they do not load.
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
SAVE=${GPU_CHECK_SAVE:-0}
for arg in "$@"; do
    case $arg in
        --save-results) SAVE=1 ;;
        *) echo "gpu_check.sh: unknown argument $arg (known: --save-results)" >&2; exit 2 ;;
    esac
done
PY=${PYTHON:-}
if [ -z "$PY" ]; then
    for cand in python3 python; do
        if command -v "$cand" >/dev/null 2>&1; then PY=$cand; break; fi
    done
fi
if [ -z "$PY" ]; then
    echo "gpu_check.sh: no python3 or python on PATH (set PYTHON)"
    exit 2
fi

export KVCOPY_DEVICE=${KVCOPY_DEVICE:-cuda}
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
if [ -z "${KVCOPY_COMMIT:-}" ]; then
    KVCOPY_COMMIT=$(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo unknown)
    export KVCOPY_COMMIT
fi
if [ -n "${OUT:-}" ]; then
    GPU_CHECK_OUT=$OUT
else
    GPU_CHECK_OUT=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
fi
mkdir -p "$GPU_CHECK_OUT"
# Scratch (build tree, partial sub-results, pytest XML) stays out of $OUT: 8 files come back.
GPU_CHECK_WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_work.XXXXXX")
export GPU_CHECK_OUT GPU_CHECK_WORK
LOG=$GPU_CHECK_OUT/gpu_check.log
TOTAL=${GPU_CHECK_TOTAL_S:-330}
RESERVE=10  # the summary's seconds
T0=$SECONDS
echo "gpu_check: $PY ($(command -v "$PY")), device $KVCOPY_DEVICE, commit $KVCOPY_COMMIT, files in $GPU_CHECK_OUT" | tee -a "$LOG"

# Step budgets in seconds, most informative first (bench/gpu_check.py says what each does).
STEPS="facts:20 build:65 smoke:40 tests:60 ladder:25 sweep:55 scenario:55"
for entry in $STEPS; do
    name=${entry%%:*}
    budget=${entry##*:}
    left=$((TOTAL - RESERVE - (SECONDS - T0)))
    limit=$(( budget < left ? budget : left ))
    echo "== [$((SECONDS - T0))s] $name (limit ${limit}s)" | tee -a "$LOG"
    if [ "$limit" -lt 5 ]; then
        echo "   not run: the ${TOTAL}s total is spent" | tee -a "$LOG"
        continue
    fi
    # stdout: the step's short lines (also in the log); stderr: the log only.
    timeout --kill-after=5 "$limit" "$PY" bench/gpu_check.py "$name" --limit "$limit" 2>>"$LOG"
    rc=$?
    if [ $rc -ne 0 ]; then
        [ $rc -eq 124 ] || [ $rc -eq 137 ] && echo "   $name: TIMED OUT after ${limit}s" | tee -a "$LOG"
        "$PY" bench/gpu_check.py mark "$name" --rc "$rc" 2>>"$LOG"
    fi
    if [ "$name" = build ] && [ -f "$GPU_CHECK_WORK/lib_dir" ]; then
        KVCOPY_LIB_DIR=$(cat "$GPU_CHECK_WORK/lib_dir")
        export KVCOPY_LIB_DIR
        echo "   later steps load the rebuilt libraries from $KVCOPY_LIB_DIR" | tee -a "$LOG"
    fi
done

if [ "$SAVE" = 1 ]; then
    "$PY" bench/gpu_check.py save "$GPU_CHECK_OUT" --results "$ROOT/bench/results" 2>>"$LOG" | tee -a "$LOG"
fi
echo "== [$((SECONDS - T0))s] summary" >>"$LOG"
timeout --kill-after=2 "$RESERVE" "$PY" bench/gpu_check.py summary 2>>"$LOG"
rc=$?
rm -rf "$GPU_CHECK_WORK"
echo "gpu_check: $((SECONDS - T0))s in all, exit $rc; log and JSON in $GPU_CHECK_OUT"
exit $rc
