"""kvcopy.nixl.engine.info: which peers can serve an engine (layer pairing, what must
match and what may differ), decided on the engine records alone."""
import dataclasses

import pytest
import torch

from kvcopy.nixl.engine.info import EngineInfo, pair_layers
from kvcopy.nixl.engine.regions import build_regions
from kvcopy.testing.nixl.engines import ToyEngine, build_case, engine_info

NP = 16


def _engine(dtype=torch.float16, tokens=16, heads=2, tpb=16, names=("a0", "a1"), head_size=8):
    caches = {n: torch.empty(NP, tokens, heads, head_size, dtype=dtype) for n in names}
    return ToyEngine(caches, [list(names)], [tpb], tokens)


@pytest.mark.parametrize("peer, tp, match", [
    (_engine(dtype=torch.float32), 1, r"layer 'a0': element size 2 \(local\) vs 4 \(peer\)"),
    (_engine(heads=4), 1, r"total KV heads 2 \(local\) vs 4 \(peer\)"),
    (_engine(names=("a0",)), 1, r"1 layer\(s\) not on the peer .*\['a1'\]"),
    (_engine(head_size=16), 1, r"head size 8 \(local\) vs 16 \(peer\)"),
    (ToyEngine({n: torch.empty(NP, 16, 32, dtype=torch.float16) for n in ("a0", "a1")}, [["a0", "a1"]], [16], 16),
     1, r"layout kind blocks_first \(local\) vs mla \(peer\)"),
    (ToyEngine({n: torch.empty(2, NP, 16, 2, 8, dtype=torch.float16) for n in ("a0", "a1")}, [["a0", "a1"]],
               [16], 16), 1, r"chunks per page 1 \(local\) vs 2 \(peer\)"),
])
def test_incompatible_peers_are_refused_naming_the_difference(peer, tp, match):
    local = engine_info(_engine(), "D")
    remote = dataclasses.replace(engine_info(peer, "P"), tp_size=tp)
    with pytest.raises(ValueError, match=match):
        pair_layers(local, remote)


def test_compatible_peer_pairs_each_layer_with_its_group_and_region():
    eng = build_case("hybrid", NP)
    pairs = pair_layers(engine_info(eng, "D"), engine_info(eng, "P"))
    assert sorted((p.layer, p.local_group, p.remote_group) for p in pairs) == [
        ("l0", 0, 0), ("l1", 1, 1), ("l2", 0, 0), ("l3", 1, 1), ("l4", 0, 0), ("l5", 1, 1)]
    assert {p.layer: p.local_region for p in pairs}["l0"] == {p.layer: p.local_region for p in pairs}["l1"]


def test_different_page_sizes_tp_sizes_and_kv_layouts_pair():
    """Heterogeneous peers are accepted at the handshake: plans slice pages and heads."""
    local = engine_info(_engine(), "D")
    for peer in (_engine(tokens=32, tpb=64), _engine(tokens=4, tpb=4)):
        assert len(pair_layers(local, engine_info(peer, "P"))) == 2
    # TP: D rank 1 of 2 holds head 1 of 2; P (TP 1) holds both
    caches = {n: torch.empty(NP, 16, 1, 8, dtype=torch.float16) for n in ("a0", "a1")}
    regions = build_regions(caches, [["a0", "a1"]], [16], "host", tp_rank=1, tp_size=2)
    d = EngineInfo("D", "host", "DRAM", 1, 2, (16,), (16,), tuple(regions.regions), b"")
    assert len(pair_layers(d, engine_info(_engine(), "P"))) == 2
    # a peer holding none of this rank's heads is refused
    regions0 = build_regions(caches, [["a0", "a1"]], [16], "host", tp_rank=0, tp_size=2)
    p0 = EngineInfo("P0", "host", "DRAM", 0, 2, (16,), (16,), tuple(regions0.regions), b"")
    with pytest.raises(ValueError, match="holds none of the KV heads"):
        pair_layers(d, p0)
