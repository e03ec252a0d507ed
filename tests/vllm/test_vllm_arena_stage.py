"""kvcopy.vllm.arena.stage: how many D ranks read each P rank (vLLM env; the staging itself: test_vllm_arena.py)."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytest.importorskip("kvcopy.vllm", reason="vLLM 0.33 not installed (run in the vLLM env)", exc_type=ImportError)


@pytest.mark.parametrize("p_tp,d_tp,heads,expected", [
    (1, 1, 2, [1]), (2, 4, 8, [2, 2]), (4, 2, 8, [1, 1, 1, 1]), (2, 1, 8, [1, 1]),
    (4, 1, None, [1, 0, 0, 0]),  # MLA: one D rank reads one P rank; the others keep their span to the TTL
])
def test_each_p_rank_counts_the_d_ranks_that_read_it(p_tp, d_tp, heads, expected):
    from kvcopy.nixl import remote_ranks
    from kvcopy.vllm.arena.stage import readers_of

    assert [readers_of(r, p_tp, d_tp, heads) for r in range(p_tp)] == expected
    assert sum(expected) == sum(len(remote_ranks(r, d_tp, p_tp, heads)) for r in range(d_tp))
