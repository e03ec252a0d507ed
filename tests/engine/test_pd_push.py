"""P and D as real vLLM engines, the arena connector with D in push mode
(``transfer_mode: "push"``), a dense GQA model (2-layer Llama, float32 random weights):
D's greedy tokens equal a single engine's, D loaded the prompt from P (vLLM's counters),
and every request was WRITten by P and checked on D, none READ.

One pair (module scope), P first and D with P's ``kv_transfer_params`` as vLLM's proxies
send them; one batch with every prompt in flight at once on each side.
"""
from __future__ import annotations

import pytest

from kvcopy.testing.engine.pd import (
    PROMPT_SOURCES, counter_delta, engine_config, kv_transfer_config, load_failures, random_prompts, run_pd,
    start_pair,
)

MAX_LEN = 1024
NEW_TOKENS = 8
BLOCK = 32
LENGTHS = [1, 31, 33, 64, 129, MAX_LEN - NEW_TOKENS - 1]


@pytest.fixture(scope="module")
def pair(engine_dir, model):
    path = model("llama")
    p_cfg = engine_config(path, BLOCK, MAX_LEN, kv=kv_transfer_config("arena"))
    d_cfg = engine_config(path, BLOCK, MAX_LEN, kv=kv_transfer_config("arena", transfer_mode="push"))
    pr = start_pair(engine_dir, "push-dense", p_cfg, d_cfg)
    yield pr
    pr.close()


def test_a_pushed_batch_is_token_identical_and_loaded(pair, single):
    prompts = random_prompts(LENGTHS, seed=11)
    want = single("llama").generate(prompts, NEW_TOKENS)
    before_m, before_s = pair.d.metrics(), pair.d.rpc("kvcopy_arena_stats")[0]
    batch = run_pd(pair, prompts, NEW_TOKENS)
    assert batch.tokens == [o["token_ids"] for o in want]
    loaded = [n if n > 1 else 0 for n in LENGTHS]  # D computes a 1-token prompt itself
    assert batch.cached == loaded, load_failures(pair.d)
    after = pair.d.metrics()
    compute, hit, external = (counter_delta(before_m, after, k) for k in PROMPT_SOURCES)
    assert (external, hit, compute) == (sum(loaded), 0, sum(LENGTHS) - sum(loaded))
    stats = pair.d.rpc("kvcopy_arena_stats")[0]
    # every request (a 1-token prompt's too: vLLM asks for it, then computes it) pushed and checked
    assert stats["push_landed"] - before_s["push_landed"] == len(prompts), stats
    assert stats["checksum_checked"] - before_s["checksum_checked"] == len(prompts), stats
    assert stats["checksum_failed"] == before_s["checksum_failed"], stats
    assert stats["push_held_spans"] == 0 and stats["push_reserved"] == 0, stats
