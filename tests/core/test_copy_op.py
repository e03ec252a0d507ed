"""kvcopy.copy_blocks: vLLM's CopyBlocksOp, bit-exact, stricter on bad input."""
import pytest
import torch

import kvcopy
from kvcopy.core import copy_op
from kvcopy.testing.reference import reference_copy
from kvcopy.testing import bytes_equal


def _caches(n_layers=3, nb=16, fill=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(n_layers):
        raw = torch.full((nb, 4, 2, 8), fill, dtype=torch.int16) if fill is not None else \
            torch.randint(-2**15, 2**15, (nb, 4, 2, 8), dtype=torch.int16, generator=g)
        out[f"model.layers.{i}.self_attn.attn"] = raw.view(torch.bfloat16)
    return out


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("backend", ["auto", "torch", "cpu"])
def test_matches_vllm_semantics(direction, backend):
    src, dst = _caches(seed=1), _caches(fill=-23131)
    expected = {k: v.clone() for k, v in dst.items()}
    src_ids, dst_ids = [5, 6, 7, 1], [0, 1, 2, 9]
    for k in src:
        reference_copy(src[k], expected[k], src_ids, dst_ids)
    kvcopy.copy_blocks(src, dst, src_ids, dst_ids, direction, backend=backend)
    assert all(bytes_equal(dst[k], expected[k]) for k in dst)


def test_vllm_group_loop_calls_reuse_one_copier():
    src, dst = _caches(seed=1), _caches(fill=0)
    copy_op._copiers.clear()
    for ids in ([1, 2], [3], [8, 9, 10]):  # sync_recved_kv_to_device's per-group loop
        kvcopy.copy_blocks(src, dst, ids, ids, "h2d")
    assert len(copy_op._copiers) == 1
    for k in src:
        assert bytes_equal(dst[k][[1, 2, 3, 8, 9, 10]], src[k][[1, 2, 3, 8, 9, 10]])
        assert int(dst[k].view(torch.int16)[[0, 4, 5, 6, 7, 11]].abs().sum()) == 0


def test_empty_lists_are_a_noop():
    src, dst = _caches(seed=1), _caches(fill=0)
    kvcopy.copy_blocks(src, dst, [], [], "h2d")
    assert all(int(t.view(torch.int16).abs().sum()) == 0 for t in dst.values())


@pytest.mark.parametrize("args", [
    ({}, "dst", [1], [1]), ("src", {}, [1], [1]), ("src", "dst", [], [1]), ("src", "dst", [1], []),
    ("src", "dst", [1, 2], [1]),  # different lengths: vLLM returns without copying
])
def test_inputs_vllm_ignores_are_a_noop(args):
    src, dst = _caches(seed=1), _caches(fill=0)
    a = [src if x == "src" else dst if x == "dst" else x for x in args]
    for direction in ("h2d", "d2h"):
        assert kvcopy.copy_blocks(*a, direction) is None
    assert all(int(t.view(torch.int16).abs().sum()) == 0 for t in dst.values())


def test_extra_destination_layers_are_left_alone():
    """vLLM loops over the source dict; destination layers it does not name stay."""
    src, dst = _caches(n_layers=2, seed=1), _caches(n_layers=3, fill=0)
    kvcopy.copy_blocks(src, dst, [4, 5], [0, 1], "h2d")
    for k in src:
        assert bytes_equal(dst[k][[0, 1]], src[k][[4, 5]])
    assert not dst["model.layers.2.self_attn.attn"].view(torch.int16).any()


def test_d2h_from_shared_device_bytes_into_separate_host_buffers():
    """Hybrid groups overlaid from byte 0 and KV-sharing layers: every host buffer gets
    the shared device bytes, as vLLM's save_kv_to_host does."""
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(-2**15, 2**15, (16, 4, 2, 8), dtype=torch.int16, generator=g).view(torch.bfloat16)
    other = torch.randint(-2**15, 2**15, (16, 4, 2, 8), dtype=torch.int16, generator=g).view(torch.bfloat16)
    dev = {"full.0": shared, "swa.0": shared, "shared.0": shared, "full.1": other}
    host = {k: torch.full_like(v, -7.0) for k, v in dev.items()}
    expected = {k: v.clone() for k, v in host.items()}
    for k in dev:  # vLLM's loop: dst[ids] = src[ids]
        expected[k][[0, 3, 9]] = dev[k][[1, 2, 3]]
    kvcopy.copy_blocks(dev, host, [1, 2, 3], [0, 3, 9], "d2h")
    assert all(bytes_equal(host[k], expected[k]) for k in host)


def test_bad_input_raises_and_writes_nothing():
    src, dst = _caches(seed=1), _caches(fill=0)
    with pytest.raises(ValueError, match="direction must be"):
        kvcopy.copy_blocks(src, dst, [1], [1], "up")
    with pytest.raises(ValueError, match="source layers not in the destination"):
        kvcopy.copy_blocks(src, {k: v for k, v in list(dst.items())[:2]}, [1], [1], "h2d")
    with pytest.raises(ValueError, match="out of range"):
        kvcopy.copy_blocks(src, dst, [1, 99], [1, 2], "d2h")
    with pytest.raises(ValueError, match="written twice"):
        kvcopy.copy_blocks(src, dst, [1, 2], [3, 3], "h2d")
    assert all(int(t.view(torch.int16).abs().sum()) == 0 for t in dst.values())


def test_direction_contradicting_devices_raises():
    src, dst = _caches(seed=1), _caches(fill=0)
    meta = {k: torch.empty_like(v, device="meta") for k, v in src.items()}
    with pytest.raises(ValueError, match="'h2d' but source layer .* is on meta"):
        kvcopy.copy_blocks(meta, dst, [1], [1], "h2d")
    with pytest.raises(ValueError, match="'d2h' but destination layer .* is on meta"):
        kvcopy.copy_blocks(src, meta, [1], [1], "d2h")


def test_hybrid_caches_through_one_id_list_are_refused_not_corrupted():
    """vLLM's host-buffer sync overwrote received KV in hybrid models: two layers on one
    device tensor with their own host buffers. One id list for both would let one
    layer's unfilled host pages overwrite the other's KV."""
    shared = torch.zeros(16, 4, 2, 8, dtype=torch.bfloat16)
    dev = {"full.0": shared, "swa.0": shared}
    host = {"full.0": torch.ones_like(shared), "swa.0": torch.full_like(shared, 2.0)}
    with pytest.raises(ValueError, match=r"order-dependent.*'full.0', 'swa.0'.*KvcopyNixlConnector"):
        kvcopy.copy_blocks(host, dev, [1, 2], [1, 2], "h2d")
    assert not shared.view(torch.int16).any()
    # the per-group copier does it right: each layer at its own group's blocks
    kvcopy.BlockCopier(dev, host, [["full.0"], ["swa.0"]]).to_device([[1], [2]])
    assert (shared[1] == 1).all() and (shared[2] == 2).all() and not shared[[0, 3]].view(torch.int16).any()


def test_h2d_shared_device_bytes_from_one_host_buffer_is_well_defined():
    """Two names for one device tensor and one host buffer: every order gives the same bytes."""
    shared = torch.zeros(16, 4, 2, 8, dtype=torch.bfloat16)
    hbuf = torch.randint(-2**15, 2**15, (16, 4, 2, 8), dtype=torch.int16).view(torch.bfloat16)
    kvcopy.copy_blocks({"a": hbuf, "b": hbuf}, {"a": shared, "b": shared}, [3, 4], [5, 6], "h2d")
    assert bytes_equal(shared[[5, 6]], hbuf[[3, 4]])
    assert not shared[[0, 1, 2, 3, 4, 7]].view(torch.int16).any()


def test_caches_that_are_not_tensors_are_a_type_error():
    """numpy arrays as caches raised AttributeError ('numpy.ndarray' has no 'device')."""
    import numpy as np

    good = _caches(n_layers=1)
    name = next(iter(good))
    array = {name: np.zeros((16, 4, 2, 8), dtype=np.int16)}
    for src, dst in ((array, good), (good, array)):
        for direction in ("h2d", "d2h"):
            with pytest.raises(TypeError, match=rf"kv_caches\[{name!r}\] is a ndarray, not a torch.Tensor"):
                kvcopy.copy_blocks(src, dst, [1], [1], direction)
    with pytest.raises(TypeError, match="mapping of layer names"):
        kvcopy.copy_blocks([good[name]], good, [1], [1], "h2d")
