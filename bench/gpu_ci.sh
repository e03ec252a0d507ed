#!/usr/bin/env bash
# bench/gpu_ci.sh: the steps of the GPU workflow (.github/workflows/gpu.yml) after the
# install, in one script so that they can be rehearsed on the CPU:
#
#   bash bench/gpu_ci.sh                           # on a GPU runner (the workflow)
#   KVCOPY_DEVICE=cpu OUT=/tmp/r bash bench/gpu_ci.sh   # the CPU rehearsal (tests/bench/test_gpu_check.py)
#
# 1. torch must see a CUDA device (skipped in the CPU rehearsal);
# 2. every `gpu`-marked test, with --require-gpu on a GPU (a skipped GPU test fails):
#    $OUT/pytest-gpu.xml (JUnit) and $OUT/pytest-gpu.log;
# 3. bench/gpu_check.sh, its log and JSON files in $OUT/gpu_check/.
# Python is $PYTHON, else python3. OUT defaults to ./gpu-ci-out. Exit 1 if a step failed.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/gpu-ci-out}
mkdir -p "$OUT"
rc=0
require=(--require-gpu)
if [ "${KVCOPY_DEVICE:-cuda}" = cpu ]; then
    require=()  # the CPU rehearsal: the GPU tests skip, as they do in .ci/run
    echo "gpu_ci: CPU rehearsal (KVCOPY_DEVICE=cpu): no device check, GPU tests skip"
else
    "$PY" -c "import sys, torch
print('gpu_ci: torch', torch.__version__, 'CUDA', torch.version.cuda, 'devices', torch.cuda.device_count())
sys.exit(0 if torch.cuda.is_available() else 1)" || { echo "gpu_ci: torch sees no CUDA device" >&2; rc=1; }
fi
"$PY" -m pytest -q -m gpu "${require[@]}" -p no:cacheprovider --junitxml="$OUT/pytest-gpu.xml" tests/ \
    > "$OUT/pytest-gpu.log" 2>&1
prc=$?
tail -n 25 "$OUT/pytest-gpu.log"
[ "$prc" -eq 0 ] || { echo "gpu_ci: the GPU tests failed (exit $prc)" >&2; rc=1; }
OUT="$OUT/gpu_check" bash bench/gpu_check.sh || rc=1
echo "gpu_ci: exit $rc; results in $OUT"
exit $rc
