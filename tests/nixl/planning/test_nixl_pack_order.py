"""Pack order v2: units in forward order (natural layer-name order, state units last)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kvcopy.nixl.engine.regions import build_regions
from kvcopy.nixl.planning.pack_order import (
    HEAD_ORDER, ORDER, STATE_PAGE_TOKENS, granule_for, natural_key, span_layout, stage_units,
)
from kvcopy.nixl.wire.handshake import MAX_TOKENS_PER_BLOCK
from kvcopy.testing.nixl.geometries import LAYOUTS, build_caches, engine_info, random_spec


def _regions(names, state=(), tokens=16, heads=2, size=8):
    """One float16 HND cache per layer (``[blocks, 2, heads, tokens, size]``) and, for
    ``state``, a state layer (``[blocks, 96]`` int8 rows, one group of its own, as
    kvcopy.vllm.groups views vLLM's state)."""
    caches = {n: torch.zeros(6, 2, heads, tokens, size, dtype=torch.float16) for n in names}
    caches.update({n: torch.zeros(6, 96, dtype=torch.int8) for n in state})
    groups = [list(names)] + ([list(state)] if state else [])
    tpb = [tokens] + ([STATE_PAGE_TOKENS] if state else [])
    return build_regions(caches, groups, tpb, "device", 0, "HND").regions


def test_natural_key_orders_digit_runs_as_integers():
    names = ["model.layers.10.attn", "model.layers.2.attn", "model.layers.1.attn", "lm.1x2", "lm.1x10"]
    assert sorted(names, key=natural_key) == ["lm.1x2", "lm.1x10", "model.layers.1.attn", "model.layers.2.attn",
                                              "model.layers.10.attn"]
    # string order, v1's, put layer 10 before layer 2
    assert sorted(names)[2:] == ["model.layers.1.attn", "model.layers.10.attn", "model.layers.2.attn"]


@pytest.mark.parametrize("order", [ORDER, HEAD_ORDER])
def test_units_follow_the_forward_order_past_ten_layers(order):
    names = [f"model.layers.{i}.self_attn.attn" for i in range(13)]
    shuffled = [names[i] for i in np.random.default_rng(0).permutation(13)]
    units = stage_units(_regions(shuffled), order)
    assert [u.layers[0] for u in units][::len(units) // 13] == names
    segs, total = span_layout(units, [3])
    assert segs == sorted(segs) and total > segs[-1]  # consecutive layers, contiguous front to back


def test_state_units_come_after_every_attention_unit():
    names = [f"model.layers.{i}.self_attn.attn" for i in (3, 7, 11)]
    state = [f"model.layers.{i}.linear_attn" for i in (0, 1, 2, 4)]
    assert STATE_PAGE_TOKENS == MAX_TOKENS_PER_BLOCK  # a state region is told by the handshake alone
    units = stage_units(_regions(names, state))
    assert [u.state for u in units] == [False] * 3 + [True] * 4
    assert [u.layers[0] for u in units] == names + state  # the state units in their own forward order


def test_both_sides_compute_the_order_from_the_handshake_alone():
    """A random engine's units from its own regions and from its handshake's (P's view
    of D and back): the same order, the same granule, sorted as v2 says."""
    for seed in range(20):
        spec = random_spec(np.random.default_rng(seed), seed)
        for which in ("p", "d"):
            caches = build_caches(spec, which, 0)
            info = engine_info(spec, which, 0, caches, f"e{which}")
            units = stage_units(info.regions)
            again = stage_units([dataclasses.replace(r) for r in info.regions])
            assert units == again
            assert granule_for(units) == granule_for(again)
            keys = [(u.state, natural_key(u.layers[0])) for u in units]
            assert keys == sorted(keys)
            for u in units:
                assert list(u.layers) == sorted(u.layers, key=natural_key)
    assert LAYOUTS  # the fuzzer's layouts (every one reached by random_spec over the seeds)
