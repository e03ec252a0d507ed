"""Regions: one host buffer per device storage, aliasing, KV-sharing layers, descriptors."""
import numpy as np
import pytest
import torch

from kvcopy.nixl.engine.regions import build_regions, tokens_per_group
from kvcopy.testing.nixl.engines import build_case
from kvcopy.testing.nixl.oracle import fill_random

NP = 12


def test_hybrid_host_buffers_one_per_device_storage_and_kv_sharing_layers_get_none():
    eng = build_case("hybrid", NP)
    rs = build_regions(eng.device_caches, eng.layer_groups, [16, 16], "host")
    # storages: the tensor l0/l1 share, and the pool l2..l5 view; l6 (KV-sharing) and l7 add none
    assert len(rs.storages) == 2
    assert sorted(sorted(s.layers) for s in rs.storages) == [["l0", "l1"], ["l2", "l3", "l4", "l5"]]
    assert set(rs.host_views) == {"l0", "l1", "l2", "l3", "l4", "l5"}
    members = sorted(sorted(r.members) for r in rs.regions)
    assert members == [[("l0", 0), ("l1", 1)], [("l2", 0), ("l3", 1)], [("l4", 0), ("l5", 1)]]
    # aliased layers share host bytes exactly as they share device bytes
    assert rs.host_views["l0"].data_ptr() == rs.host_views["l1"].data_ptr()
    pool = [s for s in rs.storages if "l2" in s.layers][0]
    for name in ("l2", "l4"):
        dev, host = eng.device_caches[name], rs.host_views[name]
        assert host.stride() == dev.stride() and host.shape == dev.shape and host.dtype == dev.dtype
        dev_off = dev.data_ptr() - eng.device_caches["l2"].data_ptr()
        assert host.data_ptr() - rs.host_views["l2"].data_ptr() == dev_off
        assert pool.address <= host.data_ptr() < pool.address + pool.nbytes


def test_descriptors_are_chunk_major_pages_at_the_tensor_addresses():
    eng = build_case("hybrid", NP)
    rs = build_regions(eng.device_caches, eng.layer_groups, [16, 16], "host")
    descs = rs.descriptors()
    assert len(descs) == rs.descriptor_offsets[-1]
    for r in rs.regions:
        t = rs.transfer_tensors[r.members[0][0]]
        rows = descs[rs.descriptor_offsets[r.index] : rs.descriptor_offsets[r.index + 1]]
        for c in range(r.num_chunks):
            for p in range(r.num_pages):
                page = t[c, p] if r.num_chunks == 2 else t[p]
                addr, nbytes, dev = rows[c * r.num_pages + p]
                assert (int(addr), int(nbytes), int(dev)) == (page.data_ptr(), page.numel() * 2, 0)


def test_device_mode_registers_the_caches_themselves():
    eng = build_case("hybrid", NP)
    rs = build_regions(eng.device_caches, eng.layer_groups, [16, 16], "device")
    assert rs.host_views == {}
    assert all(s.host_buffer is None and s.mem_type == "DRAM" for s in rs.storages)
    for name, t in rs.transfer_tensors.items():
        assert t is eng.device_caches[name]


def test_host_views_round_trip_bytes_through_the_copier_geometry():
    eng = build_case("hybrid", NP)
    fill_random(eng.device_caches, 3)
    rs = build_regions(eng.device_caches, eng.layer_groups, [16, 16], "host")
    for name, host in rs.host_views.items():  # same geometry: a full copy through views works
        host.copy_(eng.device_caches[name])
    for name, host in rs.host_views.items():
        assert torch.equal(host.view(torch.int16), eng.device_caches[name].view(torch.int16))


def test_heads_and_tp_rank_are_advertised():
    caches = {"x": torch.empty(NP, 16, 2, 8, dtype=torch.float16)}
    r = build_regions(caches, [["x"]], [16], "host", tp_rank=1, tp_size=4).regions[0]
    assert (r.total_kv_heads, r.heads, r.head_size) == (8, (2, 2), 8)
    one = {"x": torch.empty(NP, 16, 1, 8, dtype=torch.float16)}
    r = build_regions(one, [["x"]], [16], "host", tp_rank=3, tp_size=4, total_kv_heads=2).regions[0]
    assert (r.total_kv_heads, r.heads) == (2, (1, 1))  # replicated: ranks 2, 3 hold head 1
    mla = {"m": torch.empty(NP, 16, 32, dtype=torch.bfloat16)}
    r = build_regions(mla, [["m"]], [16], "host").regions[0]
    assert (r.kind, r.total_kv_heads, r.heads, r.head_size) == ("mla", None, None, 32)


@pytest.mark.parametrize("groups, tpp, match", [
    ([["a"], ["a"]], [16, 16], "is in group 0 and group 1"),
    ([["nope"]], [16], "no device cache"),
    ([["a"]], [8], "holds 16 tokens per page"),
])
def test_bad_layer_groups_raise(groups, tpp, match):
    caches = {"a": torch.empty(NP, 16, 2, 8, dtype=torch.float16)}
    with pytest.raises(ValueError, match=match):
        build_regions(caches, groups, tpp, "host")


def test_bad_heads_and_modes_raise():
    caches = {"a": torch.empty(NP, 16, 2, 8, dtype=torch.float16)}
    with pytest.raises(ValueError, match="total KV heads"):
        build_regions(caches, [["a"]], [16], "host", tp_size=2, total_kv_heads=6)
    with pytest.raises(ValueError, match="buffer must be"):
        build_regions(caches, [["a"]], [16], "pinned")
    with pytest.raises(ValueError, match="tp_rank"):
        build_regions(caches, [["a"]], [16], "host", tp_rank=2, tp_size=2)
    with pytest.raises(ValueError, match="no layer in any KV cache group"):
        build_regions(caches, [[]], [16], "host")
    meta = {"a": caches["a"], "b": torch.empty(NP, 16, 2, 8, dtype=torch.float16, device="meta")}
    with pytest.raises(ValueError, match="several devices"):
        build_regions(meta, [["a", "b"]], [16], "host")


def test_tokens_per_group_checks_division():
    assert tokens_per_group(128, 64, 2) == ([128, 128], [64, 64])
    assert tokens_per_group([32, 16], None, 2) == ([32, 16], [32, 16])
    with pytest.raises(ValueError, match="not a multiple"):
        tokens_per_group(96, 64, 1)
    with pytest.raises(ValueError, match="one value per KV cache group"):
        tokens_per_group([16], None, 2)
    assert np.array_equal(np.array(tokens_per_group(16, 16, 1)), [[16], [16]])


def test_views_of_the_same_bytes_with_other_page_shapes_are_separate_regions():
    """vLLM overlays its KV cache groups from byte 0: one group's layer 0 views 4 heads x 16
    tokens per page, another's 2 heads x 32 tokens (a doubled block size that unifies page
    sizes), or GDN state rows; same address and strides, other pages: two regions, each
    with its own group's tokens per page."""
    pool = torch.zeros(8 * 4 * 16 * 32, dtype=torch.float16)
    a = pool.view(8, 4, 16, 32)  # [pages, heads, tokens, size]: 4 x 16
    b = pool.view(8, 2, 32, 32)  # 2 x 32
    state = pool.view(torch.int8).view(8, -1)[:, :1000]  # a state row per page, shorter than the page
    rs = build_regions({"a": a, "b": b, "s": state}, [["a"], ["b"], ["s"]], [16, 32, 1 << 20], "device",
                       kv_layout="HND")
    assert sorted(r.members for r in rs.regions) == [(("a", 0),), (("b", 1),), (("s", 2),)]
    assert {r.members[0][0]: r.tokens_per_page for r in rs.regions} == {"a": 16, "b": 32, "s": 1 << 20}
