"""P and D as real vLLM engines, a dense GQA model (2-layer Llama, 2 KV heads, float32
random weights), each connector: D's greedy tokens equal a single engine's, and D loaded
the prompt from P instead of computing it.

One P/D pair per connector (module scope): vLLM's stock ``NixlConnector``, the control;
``KvcopyNixlConnector`` through its host buffers (``host_buffer_on_cpu``); the arena
connector. A batch puts all its prompts in flight at once on each side.

The arena pair runs with vLLM's default CPU binding (what a user gets; the READ stall of
``kvcopy.vllm.affinity`` showed there). The two pairs on vLLM's NIXL worker run unbound
(``VLLM_CPU_OMP_THREADS_BIND=nobind``): on the CPU platform that worker moves its engine
thread to the core vLLM reserves for KV transfer, away from its OpenMP threads, and with
the default binding D decoded at 0.2-0.4 tokens/s here (a batch 14-80 s instead of 3-5 s).
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
UNBOUND = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
# At and around the block size, and near max_model_len (P's 1 token and D's 8 fit).
LENGTHS = [1, 31, 32, 33, 63, 64, 65, 129, MAX_LEN - NEW_TOKENS - 1]


def loaded(n: int) -> int:
    """The prompt tokens vLLM counts on D as loaded from P (``num_cached_tokens``) for a
    dense model: all of them (D recomputes the last one for its logits but counts it), and
    none of a 1-token prompt, which D computes."""
    return n if n > 1 else 0


SLOW = pytest.mark.slow
# CI runs the kvcopy connectors' cases; vLLM's stock connector (the control) and the
# mirror connector's prefix case are slow (-m slow): its D decodes at 1-2 tokens/s here.
BATCH = ["arena", "arena-layerwise", "mirror", pytest.param("stock", marks=SLOW)]
PREFIX = ["arena", pytest.param("mirror", marks=SLOW), pytest.param("stock", marks=SLOW)]


@pytest.fixture(scope="module")
def pair(request, engine_dir, model):
    connector, _, mode = request.param.partition("-")  # "arena-layerwise": P stages layer by layer
    path = model("llama")
    cfg = engine_config(path, BLOCK, MAX_LEN, kv=kv_transfer_config(connector, **({"layerwise": True} if mode else {})))
    pr = start_pair(engine_dir, f"dense-{request.param}", cfg, cfg, env=None if connector == "arena" else UNBOUND)
    pr.connector, pr.layerwise = connector, bool(mode)
    yield pr
    pr.close()


@pytest.fixture(scope="module")
def reference(single):
    return single("llama")


def _proof(pair, before_m, before_stats, prompts, batch, local_hits=0):
    """D computed only what vLLM leaves to it: its prompt-token counters grew by what was
    loaded (external), and the arena's D checked one pull per loaded request."""
    after = pair.d.metrics()
    want = sum(loaded(len(p)) for p in prompts)
    compute, hit, external = (counter_delta(before_m, after, k) for k in PROMPT_SOURCES)
    assert (external, hit, compute) == (want - local_hits, local_hits, sum(len(p) for p in prompts) - want), \
        (external, hit, compute)
    if pair.connector == "arena":
        stats = pair.d.rpc("kvcopy_arena_stats")[0]
        # one verified pull per request (a 1-token prompt's too: vLLM asks for it, then computes it)
        assert stats["checksum_checked"] - before_stats["checksum_checked"] == len(prompts), stats
        assert stats["checksum_failed"] == before_stats["checksum_failed"], stats
    if pair.connector == "mirror":
        copies = pair.d.rpc("kvcopy_mirror_copies")[0]
        assert copies["copier"] and copies["use_host_buffer"] and copies["to_device"] >= 1, copies


def _stats_before(pair):
    if pair.connector == "arena":
        return pair.d.rpc("kvcopy_arena_stats")[0]
    if pair.connector == "mirror":
        for e in (pair.p, pair.d):
            e.rpc("kvcopy_mirror_copies")  # start counting
    return {}


@pytest.mark.parametrize("pair", BATCH, indirect=True)
def test_a_batch_at_block_boundaries_and_near_max_model_len(pair, reference):
    prompts = random_prompts(LENGTHS, seed=1)
    want = reference.generate(prompts, NEW_TOKENS)
    before_m, before_s = pair.d.metrics(), _stats_before(pair)
    batch = run_pd(pair, prompts, NEW_TOKENS)
    assert batch.tokens == [o["token_ids"] for o in want]
    assert batch.cached == [loaded(n) for n in LENGTHS], load_failures(pair.d)
    _proof(pair, before_m, before_s, prompts, batch)
    if pair.layerwise:  # P copied its layers from save_kv_layer, none left to the sweep (dense: no state)
        lw = pair.p.rpc("kvcopy_layerwise_stats")[0]
        assert lw["at_layer"] > 0 and lw["swept"] == 0 and lw["no_span"] == 0, lw
    if pair.connector == "mirror":  # P saved through kvcopy's copier, D synced through it
        p_copies = pair.p.rpc("kvcopy_mirror_copies")[0]
        assert p_copies["to_host"] >= 1, p_copies


@pytest.mark.parametrize("pair", PREFIX, indirect=True)
def test_a_prefix_d_holds_is_not_loaded_again(pair, reference):
    prefix = random_prompts([128], seed=2)[0]  # four blocks
    first, second = (prefix + tail for tail in random_prompts([40, 70], seed=3))
    want = reference.generate([first, second], NEW_TOKENS)
    b1 = run_pd(pair, [first], NEW_TOKENS)
    before_m, before_s = pair.d.metrics(), _stats_before(pair)
    b2 = run_pd(pair, [second], NEW_TOKENS)
    assert [b1.tokens[0], b2.tokens[0]] == [o["token_ids"] for o in want]
    assert b2.cached == [len(second)], load_failures(pair.d)
    _proof(pair, before_m, before_s, [second], b2, local_hits=len(prefix))
