"""P and D as real vLLM engines, the arena connector with D in push mode
(``transfer_mode: "push"``), a dense GQA model (2-layer Llama, float32 random weights):
D's greedy tokens equal a single engine's, D loaded the prompt from P (vLLM's counters),
and every request was WRITten by P and checked on D, none READ.

One pair (module scope), two batches with every prompt in flight at once on each side:
P first and D with P's ``kv_transfer_params`` as vLLM's sequential proxies send them; then
as a concurrent proxy dispatches (P and D at once, one request id each prompt, D given
P's engine id and side channel only), which P matches by vLLM's base request id.

A second pair with a layer-wise P (``layerwise``, ``push_chunk_bytes`` 0): D's
reservations reach P before P has the requests, so P WRITEs each layer's units as the
forward copies them (chunked push) and the last layer's with the record: D's tokens
equal a single engine's, and chunks landed for every request.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvcopy.testing.engine.pd import (
    PROMPT_SOURCES, counter_delta, engine_config, kv_transfer_config, load_failures, random_prompts, run_pd,
    start_pair,
)
from kvcopy.testing.engine.serve import PrefillEngine

MAX_LEN = 1024
NEW_TOKENS = 8
BLOCK = 32
LENGTHS = [1, 31, 33, 64, 129, MAX_LEN - NEW_TOKENS - 1]
P_ENGINE = "push-dense-P"  # known to the concurrent proxy beforehand
P_LAYERWISE_ENGINE = "push-layerwise-P"
ACCEPT_TIMEOUT_S = 120.0  # P's housekeeping takes reservations every 50 ms; engines on 2 shared cores


@pytest.fixture(scope="module")
def pair(engine_dir, model):
    path = model("llama")
    p_cfg = engine_config(path, BLOCK, MAX_LEN, kv=dict(kv_transfer_config("arena"), engine_id=P_ENGINE))
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


def test_concurrent_dispatch_is_token_identical_and_loaded(pair, single):
    prompts = random_prompts([33, 129, 700], seed=12)
    want = single("llama").generate(prompts, NEW_TOKENS)
    ids = [10**6 + i for i in range(len(prompts))]  # one id per prompt on both engines, each adds its suffix
    d_params = PrefillEngine(P_ENGINE, "127.0.0.1", int(pair.p.env["VLLM_NIXL_SIDE_CHANNEL_PORT"])).decode_params("x")
    before = pair.d.rpc("kvcopy_arena_stats")[0]
    with ThreadPoolExecutor(1) as pool:
        p_leg = pool.submit(pair.p.generate, prompts, 1, [{"do_remote_decode": True}] * len(prompts),
                            request_ids=ids)
        outs = pair.d.generate(prompts, NEW_TOKENS, [d_params] * len(prompts), request_ids=ids)
        p_leg.result()
    assert [o["token_ids"] for o in outs] == [o["token_ids"] for o in want]
    assert [o["num_cached_tokens"] for o in outs] == [len(p) for p in prompts], load_failures(pair.d)
    stats = pair.d.rpc("kvcopy_arena_stats")[0]
    assert stats["push_landed"] - before["push_landed"] == len(prompts), stats
    assert stats["checksum_checked"] - before["checksum_checked"] == len(prompts), stats
    assert stats["checksum_failed"] == before["checksum_failed"], stats


@pytest.fixture(scope="module")
def layerwise_pair(engine_dir, model):
    path = model("llama")
    p_kv = dict(kv_transfer_config("arena", layerwise=True, push_chunk_bytes=0), engine_id=P_LAYERWISE_ENGINE)
    p_cfg = engine_config(path, BLOCK, MAX_LEN, kv=p_kv)
    d_cfg = engine_config(path, BLOCK, MAX_LEN, kv=kv_transfer_config("arena", transfer_mode="push"))
    pr = start_pair(engine_dir, "push-layerwise", p_cfg, d_cfg)
    yield pr
    pr.close()


def _accepted(p) -> int:
    return p.rpc("kvcopy_arena_stats")[0]["push_accepted"]


def test_a_layerwise_p_pushes_in_chunks_and_is_token_identical(layerwise_pair, single):
    pair = layerwise_pair
    prompts = random_prompts([65, 300, 700], seed=13)
    want = single("llama").generate(prompts, NEW_TOKENS)
    ids = [2 * 10**6 + i for i in range(len(prompts))]
    side = int(pair.p.env["VLLM_NIXL_SIDE_CHANNEL_PORT"])
    d_params = PrefillEngine(P_LAYERWISE_ENGINE, "127.0.0.1", side).decode_params("x")
    before_d = pair.d.rpc("kvcopy_arena_stats")[0]
    before_p = pair.p.rpc("kvcopy_arena_stats")[0]
    assert before_p["push_accepted"] == 0, before_p
    with ThreadPoolExecutor(1) as pool:
        d_leg = pool.submit(pair.d.generate, prompts, NEW_TOKENS, [d_params] * len(prompts), request_ids=ids)
        # P gets the requests only once it accepted every reservation (its housekeeping takes
        # them while it is idle): each request's units are then chunked as its forward copies them
        deadline = time.monotonic() + ACCEPT_TIMEOUT_S
        while _accepted(pair.p) < len(prompts):
            assert time.monotonic() < deadline and not d_leg.done(), pair.p.rpc("kvcopy_arena_stats")[0]
            time.sleep(0.05)
        pair.p.generate(prompts, 1, [{"do_remote_decode": True}] * len(prompts), request_ids=ids)
        outs = d_leg.result()
    assert [o["token_ids"] for o in outs] == [o["token_ids"] for o in want]
    assert [o["num_cached_tokens"] for o in outs] == [len(p) for p in prompts], load_failures(pair.d)
    d, p = pair.d.rpc("kvcopy_arena_stats")[0], pair.p.rpc("kvcopy_arena_stats")[0]
    assert d["push_landed"] - before_d["push_landed"] == len(prompts), d
    assert d["checksum_checked"] - before_d["checksum_checked"] == len(prompts), d
    assert d["checksum_failed"] == before_d["checksum_failed"], d
    # 2 layers: layer 0's units go in a chunk (every run: push_chunk_bytes 0), layer 1's with the record
    chunks = p["push_chunks_posted"] - before_p["push_chunks_posted"]
    assert chunks >= len(prompts), p
    assert d["push_chunks_landed"] - before_d["push_chunks_landed"] == chunks, (d, p)
    lw = pair.p.rpc("kvcopy_layerwise_stats")[0]
    assert lw["at_layer"] > 0 and lw["swept"] == 0, lw
    assert d["push_held_spans"] == 0 and d["push_reserved"] == 0, d
