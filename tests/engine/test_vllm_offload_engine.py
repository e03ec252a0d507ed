"""kvcopy's KV offloading in a real vLLM 0.33 engine on the CPU (tests/engine/vllm_offload_engine.py).

Engines one after the other, each in its own process, on the same random-weight
float32 model and prompts: without offloading (the baseline), with
``KvcopyOffloadingConnector`` + ``KvcopyOffloadingSpec``, for a 2-layer Llama (one KV
cache group) and a 4-layer Gemma 2 (sliding-window and full-attention layers: two
groups); and vLLM's ``OffloadingConnector`` with its own ``CPUOffloadingSpec``. A prompt is run, evicted
from the device cache by four others, and run again; then one bit is flipped in every
stored page on the host and it runs again (evicted first); then once more.

The tiny models are :mod:`kvcopy.testing.engine.models`'. Needs the engine environment
(``bench/engine_env.sh``); elsewhere ``tests/engine/conftest.py`` skips it, saying why.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("engines")
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    out = {}
    for family, mode in [(f, m) for f in FAMILIES for m in ("baseline", "offload")] + [("llama", "stock")]:
        path = root / f"{family}-{mode}.json"
        p = subprocess.run([sys.executable, str(ROOT / "tests" / "engine" / "vllm_offload_engine.py"), mode,
                            str(root / family), str(path), family], env=env, capture_output=True, text=True,
                           timeout=900, cwd=str(root))
        assert p.returncode == 0 and path.exists(), (family, mode, (p.stdout + p.stderr)[-3000:])
        out[family, mode] = json.loads(path.read_text())
    return out


FAMILIES = ["llama", "gemma2"]


def _phase(run, name):
    return next(p for p in run["phases"] if p["phase"] == name)


def test_vllms_own_spec_is_refused_on_the_cpu_platform(runs):
    stock = runs["llama", "stock"]
    assert "CPU Offloading is currently only supported on CUDA-alike and XPU GPUs" in stock["error"]
    assert "spec.py" in stock["traceback"] and "get_worker" in stock["traceback"]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_engine_with_kvcopys_offloading_generates_the_baselines_tokens(runs, family):
    off, base = runs[family, "offload"], runs[family, "baseline"]
    assert "error" not in off and "error" not in base, off.get("traceback") or base.get("traceback")
    assert len(off["tokens"]) == 16
    assert off["tokens"] == base["tokens"]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_evicted_prompt_is_loaded_from_the_cpu_and_vllm_counts_it(runs, family):
    reload = _phase(runs[family, "offload"], "reload")
    c = reload["counters"]
    assert c["vllm:external_prefix_cache_hits"] >= 5 * 32  # P's full 32-token blocks, from the offload tier
    assert c["vllm:kv_offload_load_bytes"] > 0 and c["vllm:kv_offload_store_bytes"] > 0
    assert c["vllm:prefix_cache_hits"] == 0  # none of it from the device cache
    assert reload["failed_loads"] == []


@pytest.mark.parametrize("family", FAMILIES)
def test_a_flipped_bit_on_the_host_fails_one_load_that_vllm_recomputes_then_loads_again(runs, family):
    off = runs[family, "offload"]
    flipped, reloaded = _phase(off, "flipped"), _phase(off, "reloaded")
    assert flipped["flipped"] > 0
    assert len(flipped["failed_loads"]) == 1  # P's load, caught by its checksums
    assert reloaded["failed_loads"] == flipped["failed_loads"]  # the recomputed P stored again: no new failure
    before, after = flipped["counters"], reloaded["counters"]
    assert after["vllm:external_prefix_cache_hits"] - before["vllm:external_prefix_cache_hits"] >= 5 * 32
    assert after["vllm:kv_offload_load_bytes"] > before["vllm:kv_offload_load_bytes"]
