"""kvcopy.vllm.arena.stats: D's pulls reach vLLM as its own NIXL connector stats.

Real connectors on vLLM-built caches (``tests/vllm/vllm_arena_engines.py``): two requests
loaded, then one whose P is gone; the stats D's connector hands vLLM
(``get_kv_connector_stats``) count each, with the bytes and descriptors of each READ, and
vLLM's own reduction of them reads as it does for its connector. Run in the vLLM env.
"""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytest.importorskip("kvcopy.vllm", reason="vLLM 0.33 not installed (run in the vLLM env)", exc_type=ImportError)

from test_vllm_mirror import CASES, vllm_env  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats  # noqa: E402

from vllm_arena_engines import ArenaEngine, decode, fill, free_port, prefill, prompts  # noqa: E402

assert vllm_env  # a fixture, used by name


def test_loads_and_failures_are_vllms_nixl_stats(vllm_env, monkeypatch):
    case = CASES["one_group"]
    p = ArenaEngine(vllm_env, case, "kv_producer", monkeypatch.setenv)
    d = ArenaEngine(vllm_env, case, "kv_consumer", monkeypatch.setenv, fetch_timeout_s=2)
    try:
        fill(p, d, 5)
        assert d.worker.get_kv_connector_stats() is None  # nothing yet
        tokens = prompts(2, [40, 70], seed=5)
        params = prefill(p, ["a", "b"], tokens)
        sizes = []
        real = d.manager.pull

        def pull(plan, *a, **kw):
            sizes.append((plan.num_bytes, plan.num_descriptors))
            return real(plan, *a, **kw)
        monkeypatch.setattr(d.manager, "pull", pull)
        assert decode(d, [p], ["a", "b"], tokens, params) == set()
        stats = d.worker.get_kv_connector_stats()
        assert isinstance(stats, NixlKVConnectorStats)
        assert sorted(zip(stats.data["bytes_transferred"], stats.data["num_descriptors"])) == sorted(sizes)
        assert len(sizes) == 2 and all(n == 1 for _, n in sizes)  # one descriptor per request
        assert all(t >= post >= 0 for t, post in zip(stats.data["transfer_duration"], stats.data["post_duration"]))
        assert stats.data["num_failed_transfers"] == []
        assert stats.reduce()["Num successful transfers"] == 2
        assert d.worker.get_kv_connector_stats() is None  # taken
        # a P that is not there: the load fails, counted as a failed transfer
        gone = dict(params[0], remote_port=free_port(), remote_request_id="gone")
        assert decode(d, [p], ["c"], [tokens[0]], [gone], limit_s=30) == {"c"}
        stats = d.worker.get_kv_connector_stats()
        assert stats is not None and stats.num_successful_transfers == 0
        assert stats.data["num_failed_transfers"] == [1]
    finally:
        d.close()
        p.close()
