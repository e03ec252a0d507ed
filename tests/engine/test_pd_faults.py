"""Faults between real engines with the arena connector, ``kv_load_failure_policy="recompute"``:
D still returns the single engine's tokens, and says in its log and counters that the load
failed.

One D (module scope) and one P whose arena holds 512 tokens of this model (1 MiB), in
order: a bit flipped in P's staged span after its pack (the test hook
``kvcopy_flip_staged_byte``, as faulty memory or a faulty link would), a prompt larger
than P's arena, P killed (its whole process group) after it staged the request and
before D reads it (last: P is gone after it).
"""
from __future__ import annotations

import os

import pytest

from kvcopy.testing.engine.pd import (
    PROMPT_SOURCES, counter_delta, engine_config, kv_transfer_config, prefill_params, random_prompts,
    side_channel_env,
)
from kvcopy.testing.engine.process import Engine

NEW_TOKENS = 8
FETCH_TIMEOUT_S = 10  # D's wait for a dead P's side channel


@pytest.fixture(scope="module")
def engines(engine_dir, model):
    path = model("llama")
    p = Engine("faults-P", engine_config(path, 32, kv=kv_transfer_config("arena", arena_bytes=1 << 20)),
               os.path.join(engine_dir, "faults-P.log"), side_channel_env())
    d = Engine("faults-D", engine_config(path, 32, kv=kv_transfer_config("arena", fetch_timeout_s=FETCH_TIMEOUT_S)),
               os.path.join(engine_dir, "faults-D.log"), side_channel_env())
    try:
        p.start()
        d.start()
        yield p.wait_ready(), d.wait_ready()
    finally:
        d.close()
        p.close()


def _recomputed(d, prompt, params, want, log_says):
    """D's run of one request whose load must fail: the single engine's tokens, nothing
    counted as loaded, and ``log_says`` in a new line of D's log."""
    log_before = len(d.log())
    before = d.metrics()
    (out,) = d.generate([prompt], NEW_TOKENS, [params])
    after = d.metrics()
    assert out["token_ids"] == want
    assert out["num_cached_tokens"] == 0
    assert counter_delta(before, after, PROMPT_SOURCES[2]) == 0
    assert counter_delta(before, after, PROMPT_SOURCES[0]) == len(prompt)
    new_log = d.log()[log_before:]
    assert "vLLM recomputes it" in new_log and log_says in new_log, new_log[-2000:]


def test_a_bit_flipped_in_ps_staged_span_fails_the_load_by_its_checksum(engines, single):
    p, d = engines
    prompt = random_prompts([100], seed=21)[0]
    want = single("llama").generate([prompt], NEW_TOKENS)[0]["token_ids"]
    (params,) = prefill_params(p, [prompt])
    assert p.rpc("kvcopy_flip_staged_byte") == [1]
    failed = d.rpc("kvcopy_arena_stats")[0]["checksum_failed"]
    _recomputed(d, prompt, params, want, "checksum")
    assert d.rpc("kvcopy_arena_stats")[0]["checksum_failed"] == failed + 1


def test_a_prompt_larger_than_ps_arena_is_recomputed(engines, single):
    p, d = engines
    prompt = random_prompts([900], seed=22)[0]  # 29 blocks: 1.8 MiB on P
    want = single("llama").generate([prompt], NEW_TOKENS)[0]["token_ids"]
    (params,) = prefill_params(p, [prompt])
    _recomputed(d, prompt, params, want, "P failed")


def test_p_killed_before_d_reads_is_recomputed(engines, single):
    p, d = engines
    prompt = random_prompts([120], seed=23)[0]
    want = single("llama").generate([prompt], NEW_TOKENS)[0]["token_ids"]
    (params,) = prefill_params(p, [prompt])
    p.kill()
    assert not p.alive()
    _recomputed(d, prompt, params, want, "failed")
