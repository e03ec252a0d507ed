#!/usr/bin/env bash
# bench/gpu_check.sh: everything a lent GPU machine should run, in about 5 minutes.
#
#   bash bench/gpu_check.sh            # from the repository root, on the GPU machine
#   KVCOPY_COMMIT=$(git rev-parse HEAD) bash bench/gpu_check.sh   # where .git did not travel
#   KVCOPY_DEVICE=cpu KVCOPY_SKIP_BUILD=1 bash bench/gpu_check.sh  # smoke-test the script on a CPU
# Through the device tool: build here first (pip install -e .) and carry kvcopy/_lib
# (git-ignored) so the prebuilt sm_80/sm_90 libraries travel when the machine has no nvcc.
#
# Target: one H200, CUDA 13 driver, torch 2.11 cu130, triton 3.6, cupy-cuda13x, its own
# python, no network (no PyPI: nothing is downloaded). Steps, each under a timeout so the
# whole stays bounded (a step that fails or times out is reported; the rest still run):
#   1. facts: GPU, driver, versions                                   (~5 s)
#   2. build: pip install -e . --no-build-isolation --no-deps; else
#      setup.py build_ext --inplace; PYTHONPATH=. either way          (<= 120 s)
#   3. pytest -m gpu tests (~400 copies, a few Triton JIT compiles)  (<= 120 s)
#   4. sweep: both directions x chunks 2 KiB-2 MiB x backends, the seeds/2
#      scenario (16 layers, 6 groups, 6 blocks/group), uncapped and --max-ctas 16;
#      timing held to ~50 s, the JSON checkpointed after every point  (<= 90 s)
#   5. seeds/2 run: groups 1/2/3/6, launches per call (--op-counts)   (<= 35 s)
#   6. host overhead: 48 layers x 6 groups, one 1-token block each    (<= 25 s)
#   7. the short table, last
# JSON goes to bench/results/ (GPU name, versions, commit, date inside) and, when $OUT
# is set (the device runner), to $OUT as well so the files come back.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
DEV=${KVCOPY_DEVICE:-cuda}
RES=${KVCOPY_RESULTS:-bench/results}
STAMP=$(date -u +%Y%m%dT%H%M%SZ)
GPU_TAG=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr -c 'A-Za-z0-9\n' '-' | tr -s '-' | sed 's/-$//' | tr 'A-Z' 'a-z')
TAG="${GPU_TAG:-gpu}-${STAMP}"
export PYTHONUNBUFFERED=1
if [ -z "${KVCOPY_COMMIT:-}" ]; then
    KVCOPY_COMMIT=$(git rev-parse HEAD 2>/dev/null || echo unknown)
    export KVCOPY_COMMIT
fi
mkdir -p "$RES"
T0=$SECONDS
STATUS=()
step() { echo; echo "== [$((SECONDS - T0))s] $*"; }
note() { STATUS+=("$1"); }
run_step() {  # name, timeout seconds, command...
    local name=$1 limit=$2; shift 2
    timeout --kill-after=5 "$limit" "$@"
    local rc=$?
    if [ $rc -eq 0 ]; then note "$name: ok"
    elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then note "$name: TIMED OUT after ${limit}s"
    else note "$name: exit $rc"; fi
    return $rc
}

step "1. machine"
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv 2>&1 | head -3
command -v nvcc >/dev/null && nvcc --version | tail -2
command -v cmake >/dev/null && cmake --version | head -1 || echo "cmake: not on PATH (setup.py also tries the cmake python module)"
$PY - <<'PY'
import importlib.metadata as md, sys, torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "cuda", torch.version.cuda,
      "| device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NONE")
for d in ("triton", "cupy-cuda13x", "cupy-cuda12x", "nixl-cu12", "nixl-cu13", "pytest", "numpy", "setuptools"):
    try:
        print(f"  {d} {md.version(d)}")
    except md.PackageNotFoundError:
        pass
PY

step "2. build"
if [ -n "${KVCOPY_SKIP_BUILD:-}" ]; then
    note "build: skipped (KVCOPY_SKIP_BUILD)"
elif ! run_step build-pip 120 $PY -m pip install -e . --no-build-isolation --no-deps -q; then
    echo "pip install failed; building in place"
    run_step build-inplace 120 $PY setup.py build_ext --inplace
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
ls -l kvcopy/_lib/ 2>/dev/null
$PY -c "import kvcopy; [print(f'  {k:<7}', 'available' if v is None else 'UNAVAILABLE: ' + v) for k, v in kvcopy.available_backends().items()]"

step "3. pytest -m gpu tests"
run_step gpu-tests 120 $PY -m pytest -m gpu tests -q -rs -p no:cacheprovider

step "4. sweep: directions x chunks 2 KiB-2 MiB x backends, seeds/2 (6 groups), uncapped and 16 CTAs"
SWEEP="$RES/${TAG}-sweep.json"
run_step sweep 90 $PY -m kvcopy sweep --device $DEV --num-groups 6 \
    --backends vllm,coalesced,cuda,triton,ce,auto --max-ctas 0,16 \
    --iters 20 --warmup 2 --budget 0.25 --time-limit 50 --max-call-bytes 64M --json "$SWEEP" --quiet

step "5. seeds/2 run: groups 1/2/3/6, launches per call"
SEEDS="$RES/${TAG}-seeds2.json"
run_step seeds2 35 $PY -m kvcopy --device $DEV --op-counts --iters 50 --budget 0.5 --json "$SEEDS" --quiet

step "6. host overhead per call: 48 layers x 6 groups, 1 block each (host_us column in the JSON)"
OVER="$RES/${TAG}-overhead.json"
run_step overhead 25 $PY -m kvcopy --device $DEV --num-layers 48 --num-groups 6 --blocks-per-request 1 \
    --block-size 1 --backends cuda,triton,ce,auto --iters 100 --budget 0.5 --json "$OVER" --quiet

# -- issue 10 (layout-converting copies), a separate point: LBNHC cache vs contiguous host, 512-byte runs; goal >= 90% of memcpy
CONV="$RES/${TAG}-convert512.json"; step "6b. converting copy, 512-byte runs (issue 10)"; run_step convert512 30 $PY -m kvcopy --preset convert512 --device $DEV --backends cuda,triton,ce,auto --iters 50 --budget 0.5 --json "$CONV" --quiet && $PY bench/report.py --text "$CONV"

if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then
    cp "$RES/${TAG}"-*.json "$OUT/" 2>/dev/null
fi

step "7. summary ($((SECONDS - T0))s in all)"
for f in "$SEEDS" "$OVER"; do
    [ -f "$f" ] && $PY bench/report.py --text "$f"
done
[ -f "$OVER" ] && $PY - "$OVER" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for x in r["results"]:
    if x.get("host_us") is not None:
        print(f"  host overhead {x['method']:<10} {x['direction']}: {x['host_us']:.1f} us per call (goal < 20 us)")
PY
[ -f "$SWEEP" ] && $PY bench/report.py --text "$SWEEP"
printf '%s\n' "${STATUS[@]}"
echo "results: $RES/${TAG}-*.json"
