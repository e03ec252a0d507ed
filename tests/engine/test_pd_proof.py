"""The KV really travelled: P and D with different random weights of the same shapes, and
P and D with pages of different sizes on vLLM's CPU attention (the arena connector).

* P loads weights A, D weights B, from one model path (a link P loaded through while it
  named A's folder, then D while it named B's: both connectors refuse peers of another
  model path). D recomputes no prompt token but the last, so its tokens follow A's KV:
  they equal a reference that runs A over the prompt but its last token and B from there
  on (transformers, float32, the same folders), and differ from what B alone makes of
  the prompt.
* P's pages of 32 tokens, D's of 64: vLLM's CPU attention keeps a page's K rows before
  its V rows, so token positions do not map across page sizes; D refuses P at the
  handshake, says so in its log, and recomputes: tokens still the single engine's.
"""
from __future__ import annotations

import os

import pytest

from kvcopy.testing.engine.pd import (
    PROMPT_SOURCES, Pair, counter_delta, engine_config, kv_transfer_config, random_prompts, run_pd, side_channel_env,
)
from kvcopy.testing.engine.process import Engine

NEW_TOKENS = 8
LENGTHS = [33, 70, 200]


@pytest.fixture(scope="module")
def link(engine_dir, model):
    """``link(seed)``: the one model path both engines load, pointed at that seed's folder."""
    path = os.path.join(engine_dir, "llama-linked")

    def point(seed: int) -> str:
        if os.path.lexists(path):
            os.remove(path)
        os.symlink(model("llama", seed), path)
        return path
    return point


@pytest.fixture(scope="module")
def p_engine(engine_dir, link):
    e = Engine("proof-P", engine_config(link(0), 32, kv=kv_transfer_config("arena")),
               os.path.join(engine_dir, "proof-P.log"), side_channel_env()).start()
    yield e.wait_ready()
    e.close()


def _d_engine(engine_dir, name, path, block_size):
    return Engine(name, engine_config(path, block_size, kv=kv_transfer_config("arena")),
                  os.path.join(engine_dir, name + ".log"), side_channel_env()).start().wait_ready()


def _mixed_reference(path_a, path_b, prompt, new_tokens):
    """Greedy tokens of B continuing from A's KV of ``prompt[:-1]`` (transformers)."""
    import torch
    from transformers import AutoModelForCausalLM

    a = AutoModelForCausalLM.from_pretrained(path_a, dtype=torch.float32).eval()
    b = AutoModelForCausalLM.from_pretrained(path_b, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        past = a(torch.tensor([prompt[:-1]]), use_cache=True).past_key_values
        nxt = torch.tensor([[prompt[-1]]])
        for _ in range(new_tokens):
            res = b(nxt, past_key_values=past, use_cache=True)
            past = res.past_key_values
            tok = int(res.logits[0, -1].argmax())
            out.append(tok)
            nxt = torch.tensor([[tok]])
    return out


def test_d_with_other_weights_continues_from_ps_kv(p_engine, engine_dir, model, single, link):
    path_a, path_b = model("llama", 0), model("llama", 1)
    prompts = random_prompts(LENGTHS, seed=11)
    own = [o["token_ids"] for o in single("llama", 1).generate(prompts, NEW_TOKENS)]  # B alone
    d = _d_engine(engine_dir, "proof-D-other-weights", link(1), 32)
    try:
        before = d.metrics()
        batch = run_pd(Pair(p_engine, d), prompts, NEW_TOKENS)
        after = d.metrics()
        assert d.rpc("kvcopy_arena_stats")[0]["checksum_checked"] == len(prompts)
    finally:
        d.close()
    assert batch.cached == LENGTHS
    assert counter_delta(before, after, PROMPT_SOURCES[2]) == sum(LENGTHS)  # external: every prompt token
    mixed = [_mixed_reference(path_a, path_b, p, NEW_TOKENS) for p in prompts]
    assert batch.tokens == mixed
    assert all(t != o for t, o in zip(batch.tokens, own)), "B alone makes the same tokens: the case proves nothing"


@pytest.mark.slow  # the engine-free check: tests/vllm/test_vllm_arena_meta.py
def test_pages_of_other_sizes_on_cpu_attention_are_refused_and_recomputed(p_engine, engine_dir, single, link):
    prompts = random_prompts(LENGTHS, seed=12)
    want = [o["token_ids"] for o in single("llama").generate(prompts, NEW_TOKENS)]
    d = _d_engine(engine_dir, "proof-D-64", link(0), 64)
    try:
        before = d.metrics()
        batch = run_pd(Pair(p_engine, d), prompts, NEW_TOKENS)
        after = d.metrics()
        log = d.log()
    finally:
        d.close()
    assert batch.tokens == want
    assert batch.cached == [0] * len(prompts)
    assert counter_delta(before, after, PROMPT_SOURCES[2]) == 0
    assert "kv-split-pages-32" in log and "kv-split-pages-64" in log and "vLLM recomputes it" in log
