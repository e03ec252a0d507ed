"""kvcopy's KV offloading in a real vLLM 0.33 engine on the CPU (tests/vllm_offload_engine.py).

Three engines, one after the other, each in its own process on the same 2-layer
random-weight float32 Llama and the same prompts: without offloading (the baseline),
with ``KvcopyOffloadingConnector`` + ``KvcopyOffloadingSpec``, and with vLLM's
``OffloadingConnector`` and its own ``CPUOffloadingSpec``. A prompt is run, evicted
from the device cache by four others, and run again; then one bit is flipped in every
stored page on the host and it runs again (evicted first); then once more.

Needs a CPU engine environment (vLLM 0.33 with vLLM's CPU ops: ``bench/engine_env.sh``
builds one); skipped in the plain vLLM test environment.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _engine_env() -> str:
    """Why this interpreter cannot run a vLLM CPU engine, or ''."""
    try:
        import vllm
    except ImportError as exc:
        return f"vLLM is not installed ({exc})"
    if not vllm.__version__.startswith("0.33"):
        return f"vLLM {vllm.__version__} is not 0.33"
    if not (Path(vllm.__file__).parent / "_C.abi3.so").exists():
        return "vLLM's CPU ops (vllm/_C.abi3.so) are missing: not a CPU engine environment (bench/engine_env.sh)"
    return ""


pytestmark = pytest.mark.skipif(bool(_engine_env()), reason=_engine_env() or "-")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("engines")
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    out = {}
    for mode in ("baseline", "offload", "stock"):
        path = root / f"{mode}.json"
        p = subprocess.run([sys.executable, str(ROOT / "tests" / "vllm_offload_engine.py"), mode, str(root / "model"),
                            str(path)], env=env, capture_output=True, text=True, timeout=900, cwd=str(root))
        assert p.returncode == 0 and path.exists(), (mode, (p.stdout + p.stderr)[-3000:])
        out[mode] = json.loads(path.read_text())
    return out


def _phase(run, name):
    return next(p for p in run["phases"] if p["phase"] == name)


def test_vllms_own_spec_is_refused_on_the_cpu_platform(runs):
    assert "CPU Offloading is currently only supported on CUDA-alike and XPU GPUs" in runs["stock"]["error"]
    assert "spec.py" in runs["stock"]["traceback"] and "get_worker" in runs["stock"]["traceback"]


def test_the_engine_with_kvcopys_offloading_generates_the_baselines_tokens(runs):
    assert "error" not in runs["offload"] and "error" not in runs["baseline"], runs["offload"].get("traceback")
    assert len(runs["offload"]["tokens"]) == 16
    assert runs["offload"]["tokens"] == runs["baseline"]["tokens"]


def test_the_evicted_prompt_is_loaded_from_the_cpu_and_vllm_counts_it(runs):
    c = _phase(runs["offload"], "reload")["counters"]
    assert c["vllm:external_prefix_cache_hits"] >= 5 * 32  # P's full 32-token blocks, from the offload tier
    assert c["vllm:kv_offload_load_bytes"] > 0 and c["vllm:kv_offload_store_bytes"] > 0
    assert c["vllm:prefix_cache_hits"] == 0  # none of it from the device cache
    assert _phase(runs["offload"], "reload")["failed_loads"] == []


def test_a_flipped_bit_on_the_host_fails_one_load_that_vllm_recomputes_then_loads_again(runs):
    flipped, reloaded = _phase(runs["offload"], "flipped"), _phase(runs["offload"], "reloaded")
    assert flipped["flipped"] > 0
    assert len(flipped["failed_loads"]) == 1  # P's load, caught by its checksums
    assert reloaded["failed_loads"] == flipped["failed_loads"]  # the recomputed P stored again: no new failure
    before, after = flipped["counters"], reloaded["counters"]
    assert after["vllm:external_prefix_cache_hits"] - before["vllm:external_prefix_cache_hits"] >= 5 * 32
    assert after["vllm:kv_offload_load_bytes"] > before["vllm:kv_offload_load_bytes"]
