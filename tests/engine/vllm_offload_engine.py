"""A real vLLM 0.33 CPU engine with or without kvcopy's KV offloading, for
tests/engine/test_vllm_offload_engine.py (not a test module; run in a CPU engine environment).

    python tests/engine/vllm_offload_engine.py MODE MODEL_DIR OUT.json [FAMILY]

``MODE``: ``baseline`` (no connector), ``offload`` (``KvcopyOffloadingConnector`` with
``KvcopyOffloadingSpec``, ``kv_load_failure_policy="recompute"``) or ``stock``
(vLLM's ``OffloadingConnector`` with its own ``CPUOffloadingSpec``: what vLLM's CPU
platform says). The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
the ``uni`` executor), 16 device blocks of 32 tokens (24 for gemma2), prefix caching on, greedy
decoding. ``FAMILY``: ``llama`` (default: one KV cache group) or ``gemma2`` (sliding
window of 64 tokens and full attention alternating: two KV cache groups). The script
(the same prompts in every mode):

1. prompt P, then four other prompts (P's blocks leave the device cache), P again;
2. (``offload``) one bit flipped in the first layer's page of every sub-block stored
   so far, four more prompts, P: its load fails its checksums and vLLM recomputes it;
3. four more prompts, P: loaded again (the bad chunks were dropped, the recomputed
   blocks stored).

``OUT.json``: the tokens of every request in order, the loads whose checksums failed,
and vLLM's counters after each phase (``LLM.get_metrics()``); or the error the engine
stopped with.
"""
from __future__ import annotations

import json
import os
import sys
import traceback

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

BLOCKS = {"llama": 16, "gemma2": 24}  # a request fits, and four others evict it
COUNTERS = ("vllm:external_prefix_cache_hits", "vllm:external_prefix_cache_queries", "vllm:kv_offload_load_bytes",
            "vllm:kv_offload_store_bytes", "vllm:prefix_cache_hits")


def engine(mode: str, model_dir: str, family: str):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw = {}
    if mode != "baseline":
        spec = {"spec_name": "KvcopyOffloadingSpec", "spec_module_path": "kvcopy.vllm"} if mode == "offload" else {}
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvcopyOffloadingConnector" if mode == "offload" else "OffloadingConnector",
            kv_connector_module_path="kvcopy.vllm" if mode == "offload" else None, kv_role="kv_both",
            kv_load_failure_policy="recompute", kv_connector_extra_config={**spec, "cpu_bytes_to_use": 64 << 20})
    return LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=256, block_size=32,
               num_gpu_blocks_override=BLOCKS[family], enable_prefix_caching=True, enforce_eager=True, seed=0,
               max_num_seqs=4, disable_log_stats=False, distributed_executor_backend="uni", **kw)


def flip_stored_pages() -> int:
    """One bit of the first layer's page of every stored sub-block, in the worker's host
    tensors; returns how many."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group().connector_worker.worker
    jobs = worker.jobs
    idx = worker.kv_caches.group_data_refs[0][0].tensor_idx
    host, page = worker.cpu_tensors[idx], worker.kv_caches.tensors[idx].page_size_bytes
    subs = [int(s) for s in jobs._stored.nonzero()[0]]
    for s in subs:
        chunk, j = divmod(s, jobs.bpc)
        host[chunk, j * page + 7] ^= 0x04
    return len(subs)


def main(mode: str, model_dir: str, out_path: str, family: str = "llama") -> None:
    import numpy as np
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvcopy.testing.engine.models import build_model

    if not os.path.exists(os.path.join(model_dir, "config.json")):  # built once per family, reused by each mode
        build_model(family, model_dir)
    result = {"mode": mode, "tokens": [], "phases": []}
    try:
        llm = engine(mode, model_dir, family)
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-3000:]
        json.dump(result, open(out_path, "w"))
        return
    failed: list = []
    if mode == "offload":
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        worker = get_kv_transfer_group().connector_worker.worker
        take = worker.take_failed_loads

        def counted():
            got = take()
            failed.extend(sorted(got))
            return got
        worker.take_failed_loads = counted
    rng = np.random.default_rng(1)
    prompt = rng.integers(1, 500, 200).tolist()
    others = [rng.integers(1, 500, 200).tolist() for _ in range(12)]
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def run(tokens, name):
        out = llm.generate([TokensPrompt(prompt_token_ids=tokens)], sp, use_tqdm=False)
        result["tokens"].append([name, list(out[0].outputs[0].token_ids)])

    def phase(name, flipped=0):
        counters = {m.name: getattr(m, "value", None) for m in llm.get_metrics() if m.name in COUNTERS}
        result["phases"].append({"phase": name, "counters": counters, "failed_loads": list(failed),
                                 "flipped": flipped})

    run(prompt, "P")
    for i in range(4):
        run(others[i], f"O{i}")
    run(prompt, "P again")
    phase("reload")
    flipped = flip_stored_pages() if mode == "offload" else 0
    for i in range(4, 8):
        run(others[i], f"O{i}")
    run(prompt, "P after a flipped bit")
    phase("flipped", flipped)
    for i in range(8, 12):
        run(others[i], f"O{i}")
    run(prompt, "P reloaded")
    phase("reloaded")
    json.dump(result, open(out_path, "w"))


if __name__ == "__main__":
    main(*sys.argv[1:5])
