"""P and D as real vLLM engines on hybrid models, each connector: D's greedy tokens equal
a single engine's, and D loaded the prompt.

* ``gemma3``: a Gemma3 text model, 3 sliding-window layers (window 64) and 1 full
  attention layer, float32; vLLM's CPU backend runs it with 4 KV cache groups of one
  layer each, overlaid in one allocation.
* ``qwen3_next``: a Qwen3-Next model, 3 Gated DeltaNet (GDN, Mamba-style state) layers and
  1 full attention layer, bfloat16: vLLM's CPU GDN kernels need bf16 (or triton-cpu), and
  these random bf16 weights still give distinct greedy tokens. D's first token is
  compared: it is computed from every transferred byte (the attention KV and the GDN
  states after P's prompt minus one token). Later tokens are not: the single engine runs
  the whole prompt through GDN's chunked scan, D its last prompt token through the
  recurrent step, and in bf16 the two differ in low bits that random weights amplify (the
  1015-token prompt's second token differed, the shorter ones did not).

Prompt lengths around the block (32) and the window (64), and near max_model_len.
"""
from __future__ import annotations

import pytest

from kvcopy.testing.engine.pd import (
    PROMPT_SOURCES, counter_delta, engine_config, kv_transfer_config, load_failures, random_prompts, run_pd, start_pair,
)

MAX_LEN = 1024
NEW_TOKENS = 8
LENGTHS = [1, 31, 33, 63, 64, 65, 100, 200, MAX_LEN - NEW_TOKENS - 1]
UNBOUND = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}  # vLLM's NIXL worker pairs (see test_pd_dense.py)
DTYPE = {"gemma3": "float32", "qwen3_next": "bfloat16"}
# The GDN model's pages are padded to its state (vLLM raises the attention block size to
# match): about 19 MB per request here, so the arena is sized for the whole batch.
ARENA = {"gemma3": {}, "qwen3_next": {"arena_bytes": 512 << 20}}
SLOW = pytest.mark.slow
# vLLM's NIXL worker needs the DS conv layout for GDN (kvcopy.vllm.checks); vLLM's stock
# connector on the GDN model is not here: D's handshake with P timed out (docs/vllm.md).
CASES = [("gemma3", "arena"), pytest.param(("gemma3", "mirror"), marks=SLOW),
         pytest.param(("gemma3", "stock"), marks=SLOW), pytest.param(("qwen3_next", "arena"), marks=SLOW),
         pytest.param(("qwen3_next", "mirror"), marks=SLOW)]


def loaded(family: str, n: int) -> int:
    """Prompt tokens vLLM counts on D as loaded (``num_cached_tokens``): all but none of a
    1-token prompt, as for the dense model; for the GDN model all but the last token (vLLM
    leaves one token for D to compute the recurrent state from, ``_prefill_backoff``)."""
    if n <= 1:
        return 0
    return n - 1 if family == "qwen3_next" else n


def _id(case):
    return "-".join(case)


@pytest.fixture(scope="module", params=CASES, ids=_id)
def pair(request, engine_dir, model):
    family, connector = request.param
    kv = kv_transfer_config(connector, **(ARENA[family] if connector == "arena" else {}))
    cfg = engine_config(model(family), 32, MAX_LEN, DTYPE[family], kv=kv)
    env = None if connector == "arena" else dict(UNBOUND)
    if connector == "mirror" and family == "qwen3_next":
        env["VLLM_SSM_CONV_STATE_LAYOUT"] = "DS"
    pr = start_pair(engine_dir, f"hybrid-{family}-{connector}", cfg, cfg, env=env)
    pr.family, pr.connector = family, connector
    yield pr
    pr.close()


def test_a_batch_around_block_and_window(pair, single):
    prompts = random_prompts(LENGTHS, seed=41)
    want = [o["token_ids"] for o in single(pair.family, dtype=DTYPE[pair.family]).generate(prompts, NEW_TOKENS)]
    before = pair.d.metrics()
    checked = pair.d.rpc("kvcopy_arena_stats")[0]["checksum_checked"] if pair.connector == "arena" else 0
    batch = run_pd(pair, prompts, NEW_TOKENS)
    after = pair.d.metrics()
    if pair.family == "qwen3_next":  # the first token (module docstring)
        assert [t[:1] for t in batch.tokens] == [t[:1] for t in want]
    else:
        assert batch.tokens == want
    expect = [loaded(pair.family, n) for n in LENGTHS]
    assert batch.cached == expect, load_failures(pair.d)
    assert counter_delta(before, after, PROMPT_SOURCES[2]) == sum(expect)
    if pair.connector == "arena":
        stats = pair.d.rpc("kvcopy_arena_stats")[0]
        assert stats["checksum_checked"] - checked == len(prompts), stats  # one verified pull each
        assert stats["checksum_failed"] == 0, stats
