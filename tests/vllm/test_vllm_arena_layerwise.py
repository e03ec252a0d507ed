"""Layer-wise staging on P (``layerwise``, kvcopy.vllm.arena.layerwise) with vLLM 0.33's real
scheduler and connector worker classes, on the CPU.

P's forward is played layer by layer (``tests/vllm/vllm_arena_engines.py``: each layer
writes its KV, then ``save_kv_layer``, as vLLM's attention decorator calls it), with P's
KV poisoned before: a copy made before its layer ran would carry the poison to D. D's
backing buffer is compared whole against the expectation built from vLLM's block
tables alone.

Run in the vLLM environment (``.ci/run``); skipped where vLLM 0.33 is not installed.
"""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytest.importorskip("kvcopy.vllm", reason="vLLM 0.33 not installed (run in the vLLM env)", exc_type=ImportError)

from test_vllm_arena import engines  # noqa: E402  (the fixture)
from test_vllm_mirror import CASES, vllm_env  # noqa: E402  (the model families, the fixture)
from vllm.v1.kv_cache_interface import KVCacheLayout, MambaSpec  # noqa: E402

from vllm_arena_engines import assert_same, decode, expected_d, fill_layerwise, prefill, prompts, run  # noqa: E402

assert engines and vllm_env  # fixtures, used by name


def _layers(p):
    return p.worker.arena_worker.stager.layers


def _transfer(p, d, lengths, seed=0):
    """P prefills layer by layer, D loads: D's bytes checked whole. Returns P's layer-wise
    counters (unit copies queued by save_kv_layer, made by the sweep)."""
    fill_layerwise(p, d, seed)
    tokens = prompts(len(lengths), lengths, seed)
    rids = [f"r{seed}-{i}" for i in range(len(tokens))]
    params = prefill(p, rids, tokens)
    before = d.raw_bytes()
    assert decode(d, [p], rids, tokens, params) == set()
    n_load = [p.sched.connector.connector_scheduler._get_remote_prefill_token_count(len(t)) for t in tokens]
    exp = expected_d(p, d, [(r, r, n) for r, n in zip(rids, n_load)], before)
    assert (exp != before).any(), "the expectation moves nothing: the test would not see a missed load"
    assert_same(d, exp)
    layers = _layers(p)
    return layers.at_layer, layers.swept


def _has_state(case) -> bool:
    return any(isinstance(s, MambaSpec) for s in case["specs"].values())


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_model_family_staged_layer_by_layer(engines, name):
    case = CASES[name]
    p, d = engines(case, "kv_producer", layerwise=True), engines(case, "kv_consumer")
    at_layer, swept = _transfer(p, d, [40, 17])
    assert at_layer > 0  # attention units copied from save_kv_layer, in the forward
    if _has_state(case):
        assert swept > 0  # GDN state: no save_kv_layer, the sweep copies it
    else:
        assert swept == 0  # every unit copied as its layer finished
    assert p.stats()["partial_requests"] == 0


@pytest.mark.parametrize("layout", [x.name for x in KVCacheLayout])
def test_the_six_layouts(engines, layout):
    case = dict(CASES["hybrid_kv_sharing"], layout=layout)
    p, d = engines(case, "kv_producer", layerwise=True), engines(case, "kv_consumer")
    _transfer(p, d, [33])


@pytest.mark.parametrize("name", ["one_group", "hybrid_kv_sharing", "gdn_exact"])
def test_chunked_prefill_fills_the_span_over_several_steps(engines, name, monkeypatch):
    case = CASES[name]
    p, d = engines(case, "kv_producer", layerwise=True), engines(case, "kv_consumer")
    p.sched.max_num_scheduled_tokens = 24  # 100-token prompts: five steps each
    settles = []
    layers = _layers(p)
    real = layers.m.arena.settle

    def settle(part, block_ids, done):
        settles.append((part.rid, done))
        return real(part, block_ids, done)
    monkeypatch.setattr(layers.m.arena, "settle", settle)
    _transfer(p, d, [100, 70])
    per = {}
    for rid, done in settles:
        per.setdefault(rid, []).append(done)
    assert len(per) == 2 and all(len(v) >= 3 and v == sorted(v) for v in per.values()), per


def test_without_save_kv_layer_the_sweep_stages_everything(engines):
    """FULL CUDA graphs replay without vLLM's decorator: correctness never depends on it."""
    case = CASES["hybrid_kv_sharing"]
    p, d = engines(case, "kv_producer", layerwise=True), engines(case, "kv_consumer")
    p.ranks[0].saves = False
    at_layer, swept = _transfer(p, d, [40, 17])
    assert at_layer == 0 and swept > 0


def test_a_full_arena_at_the_first_step_falls_back_to_the_whole_request(engines):
    """Layer-wise is an optimisation: a request with no span at its first step is staged
    whole at its last (queued for space as always), and loads exactly."""
    case = CASES["one_group"]
    p, d = engines(case, "kv_producer", layerwise=True, arena_bytes=1 << 17), engines(case, "kv_consumer")
    _transfer(p, d, [100, 100, 100])  # 56 KiB spans: two fit
    assert _layers(p).no_span >= 1 and p.stats()["partial_requests"] == 0


def test_p_in_layerwise_mode_serves_d_in_pull_mode_unchanged(engines):
    """The option is P's alone: records and spans are the same (the compatibility hash too)."""
    case = CASES["one_group"]
    p, d = engines(case, "kv_producer", layerwise=True), engines(case, "kv_consumer", layerwise=True)
    assert p.worker.arena_worker.compat == d.worker.arena_worker.compat
    assert d.worker.arena_worker.stager.layers is None  # a consumer stages nothing
    _transfer(p, d, [40])
    run([d, p], lambda: p.stats()["staged_requests"] == 0)  # D's notifications free P's spans
