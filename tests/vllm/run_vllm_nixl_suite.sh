#!/usr/bin/env bash
# vLLM 0.33's own NIXL connector unit tests (-m cpu_test) with kvcopy's connector and
# worker substituted (tests/vllm/vllm_substitute.py), on the CPU, in the vLLM environment.
#
#   tests/vllm/run_vllm_nixl_suite.sh VLLM_SDIST [PYTHON] [-- extra pytest args]
#
# VLLM_SDIST: vllm-0.33.0.tar.gz (the wheel ships no tests). `pip download vllm==0.33.0
# --no-deps --no-binary :all: --no-build-isolation` downloads it, then stops at a version
# check (the metadata says 0.33.0+cpu); `pip download <the URL it printed> --no-deps
# --no-build-isolation` keeps it (needs setuptools-rust and setuptools-scm installed).
# PYTHON: the vLLM env's interpreter (default build/venv-vllm/bin/python). KVCOPY_STOCK=1
# runs the same tests without the substitution, for the baseline.
# Many of these tests build a ModelConfig for facebook/opt-125m; offline, they read its
# config.json from an HF cache this script writes (architecture facts only, no weights).
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
sdist="$(realpath "$1")"; shift
py="${1:-$repo/build/venv-vllm/bin/python}"; [ $# -gt 0 ] && shift
[ "${1:-}" = "--" ] && shift
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
tar xzf "$sdist" -C "$work" --wildcards '*/tests/*' '*/pyproject.toml'
src="$(echo "$work"/vllm-*)"
snap="$work/hf/hub/models--facebook--opt-125m/snapshots/0000000000000000000000000000000000000000"
mkdir -p "$snap" "$work/hf/hub/models--facebook--opt-125m/refs"
printf 0000000000000000000000000000000000000000 > "$work/hf/hub/models--facebook--opt-125m/refs/main"
cat > "$snap/config.json" <<'JSON'
{"architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 768, "ffn_dim": 3072,
 "num_attention_heads": 12, "num_hidden_layers": 12, "vocab_size": 50272, "max_position_embeddings": 2048,
 "word_embed_proj_dim": 768, "do_layer_norm_before": true, "activation_function": "relu",
 "torch_dtype": "float16", "bos_token_id": 2, "eos_token_id": 2, "pad_token_id": 1, "dropout": 0.1,
 "attention_dropout": 0.0, "enable_bias": true, "layer_norm_elementwise_affine": true}
JSON
plugin=(-p vllm_substitute)
[ "${KVCOPY_STOCK:-0}" = 1 ] && plugin=()
cd "$src"
HF_HOME="$work/hf" HF_HUB_OFFLINE=1 VLLM_TARGET_DEVICE=cpu PYTHONPATH="$repo/tests/vllm:$repo" \
  "$py" -m pytest -q -m cpu_test -p no:cacheprovider "${plugin[@]}" -rfE "$@" \
  tests/v1/kv_connector/unit/test_nixl_connector.py \
  tests/v1/kv_connector/unit/test_nixl_connector_hma.py \
  tests/v1/kv_connector/unit/test_nixl_desc_geometry.py
