"""``kvcopy.copy_blocks`` on the device caches vLLM 0.33 allocates, against vLLM's own op.

The caches are built as vLLM builds them: one flat int8 allocation, a 5-D byte view
``[L, B, H, N, C]`` whose strides follow the layout's stride order
(``v1/kv_cache_layout.py``, ``compute_layout_strides``), and one ``[B, H, N, C]``
layer view per layer (``create_kv_cache_views``), viewed as the cache dtype. Host
buffers are what ``initialize_host_xfer_buffer`` allocates with
``enable_permute_local_kv``: a plain contiguous ``torch.empty`` of the logical shape
per layer. So every layout but LBHNC is a layout-converting copy. The legacy caches
(KV-first ``[2, NB, N, H, D]`` and FlashInfer ``[NB, 2, N, H, D]``, allocated in HND
stride order and permuted to the logical shape, as vLLM's older
``_reshape_kv_cache_tensors`` did) are checked the same way.

The oracle is vLLM's ``copy_kv_blocks`` body, ``dst[ids] = src[ids]`` per layer, on a
clone of the whole allocation; every byte of the allocation is compared, so a write
into another layer's pages or between pages fails too. Destinations are poisoned.
When vLLM is importable (a venv with ``vllm==0.33.0``), the strides and the layer
views are also checked against vLLM's own ``compute_layout_strides`` and
``create_kv_cache_views``.
"""
from __future__ import annotations

import math

import pytest
import torch

import kvcopy
from kvcopy.testing import POISON_BYTE
from kvcopy.testing.reference import reference_copy

# v1/kv_cache_layout.py: physical order of the logical axes [L, B, H, N, C]
ORDERS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
L, NB, N = 3, 10, 4  # layers in the allocation, blocks, tokens per block


def _byte_strides(order, shape):
    """``compute_layout_strides`` without padding: innermost physical axis first."""
    strides, cur = [0] * 5, 1
    for dim in reversed(order):
        strides[dim] = cur
        cur *= shape[dim]
    return tuple(strides)


def _vllm_caches(layout: str, heads: int, c_elems: int, dtype: torch.dtype, fill):
    """(raw int8 allocation, {layer name: [B, H, N, C] view}) as vLLM 0.33 makes them."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    shape = (L, NB, heads, N, c_elems * itemsize)
    raw = _raw(math.prod(shape), fill)
    view5 = torch.as_strided(raw, shape, _byte_strides(ORDERS[layout], shape))
    return raw, {f"model.layers.{l}.self_attn.attn": view5[l].view(dtype) for l in range(L)}


def _legacy_caches(kind: str, heads: int, d: int, dtype: torch.dtype, fill):
    """KV-first [2, NB, N, H, D] or FlashInfer [NB, 2, N, H, D] in HND stride order: one
    allocation per layer of the physical HND shape, permuted to the logical one."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    physical = (2, NB, heads, N, d) if kind == "kv_first" else (NB, 2, heads, N, d)
    raws, caches = [], {}
    for l in range(L):
        raw = _raw(math.prod(physical) * itemsize, fill)
        raws.append(raw)
        caches[f"model.layers.{l}.self_attn.attn"] = raw.view(dtype).view(physical).transpose(2, 3)
    return torch.cat(raws), caches, raws


def _raw(nbytes: int, fill) -> torch.Tensor:
    if fill is None:
        return torch.randint(-128, 128, (nbytes,), dtype=torch.int8)
    return torch.full((nbytes,), fill - 256 if fill > 127 else fill, dtype=torch.int8)


def _host_buffers(caches, fill):
    out = {}
    for name, t in caches.items():
        h = torch.empty(t.shape, dtype=t.dtype)  # contiguous logical shape
        h.view(torch.uint8).copy_(_raw(h.numel() * h.element_size(), fill).view(torch.uint8).view(h.shape[:-1] + (-1,)))
        out[name] = h
    return out


def _words(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _oracle(src, dst, src_ids, dst_ids):
    """vLLM's copy_kv_blocks body: per layer, ``dst[dst_ids] = src[src_ids]``."""
    for name in src:
        _words(dst[name])[torch.tensor(dst_ids)] = _words(src[name])[torch.tensor(src_ids)].to(dst[name].device)


CASES = [(layout, heads, dt) for layout in ("LBNHC", "BLNHC", "BHLNC", "LHBNC", "LBHNC", "BLHNC")
         for heads, dt in ((4, torch.bfloat16), (3, torch.uint8))]


def _ids():
    return [7, 2, 3, 4, 9], [0, 5, 6, 1, 8]  # a run of three inside scattered ids


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("layout,heads,dtype", CASES, ids=[f"{l}-h{h}-{str(d)[6:]}" for l, h, d in CASES])
def test_vllm_033_layer_views(layout, heads, dtype, direction, backend):
    c = 2 * 64  # K and V packed: head_size 64 each
    dev_fill = POISON_BYTE if direction == "h2d" else None
    host_fill = None if direction == "h2d" else POISON_BYTE
    torch.manual_seed(0)
    raw, dev = _vllm_caches(layout, heads, c, dtype, dev_fill)
    host = _host_buffers(dev, host_fill)
    torch.manual_seed(0)
    raw_exp, dev_exp = _vllm_caches(layout, heads, c, dtype, dev_fill)
    host_exp = _host_buffers(dev_exp, host_fill)
    dev_ids, host_ids = _ids()
    if direction == "h2d":
        _oracle(host_exp, dev_exp, host_ids, dev_ids)
        kvcopy.copy_blocks(host, dev, host_ids, dev_ids, "h2d", backend=backend)
    else:
        _oracle(dev_exp, host_exp, dev_ids, host_ids)
        kvcopy.copy_blocks(dev, host, dev_ids, host_ids, "d2h", backend=backend)
    assert torch.equal(raw, raw_exp), f"{layout} {direction}: device allocation differs from vLLM's op"
    for name in host:
        assert torch.equal(_words(host[name]), _words(host_exp[name])), (layout, direction, name)


LEGACY = [("kv_first", 4, torch.bfloat16), ("kv_first", 3, torch.uint8),
          ("flashinfer", 4, torch.bfloat16), ("flashinfer", 5, torch.float16)]


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("kind,heads,dtype", LEGACY, ids=[f"{k}-h{h}-{str(d)[6:]}" for k, h, d in LEGACY])
def test_legacy_hnd_caches(kind, heads, dtype, direction, backend):
    d = 32
    dev_fill = POISON_BYTE if direction == "h2d" else None
    host_fill = None if direction == "h2d" else POISON_BYTE
    torch.manual_seed(1)
    _, dev, raws = _legacy_caches(kind, heads, d, dtype, dev_fill)
    host = _host_buffers(dev, host_fill)
    torch.manual_seed(1)
    _, dev_exp, raws_exp = _legacy_caches(kind, heads, d, dtype, dev_fill)
    host_exp = _host_buffers(dev_exp, host_fill)
    dev_ids, host_ids = _ids()
    bd = 1 if kind == "kv_first" else 0
    if direction == "h2d":
        for name in dev_exp:
            reference_copy(host_exp[name], dev_exp[name], host_ids, dev_ids, bd)
        kvcopy.copy_blocks(host, dev, host_ids, dev_ids, "h2d", backend=backend)
    else:
        for name in dev_exp:
            reference_copy(dev_exp[name], host_exp[name], dev_ids, host_ids, bd)
        kvcopy.copy_blocks(dev, host, dev_ids, host_ids, "d2h", backend=backend)
    for got, exp in zip(raws, raws_exp):
        assert torch.equal(got, exp), f"{kind} {direction}: device allocation differs"
    for name in host:
        assert torch.equal(_words(host[name]), _words(host_exp[name])), (kind, direction, name)


def test_converting_pairs_are_runs_of_c_bytes():
    """What the pairing makes of vLLM's layouts (bf16, 4 heads, C = 128 elements = 256 B
    runs): LBHNC keeps whole pages; the others move C-byte or N*C-byte runs."""
    from kvcopy.core.layout import describe, pair_pages

    expect = {"LBHNC": (4 * N * 256, 1), "BLHNC": (4 * N * 256, 1), "LBNHC": (256, 4 * N),
              "BLNHC": (256, 4 * N), "BHLNC": (N * 256, 4), "LHBNC": (N * 256, 4)}
    for layout, (run, runs) in expect.items():
        _, dev = _vllm_caches(layout, 4, 128, torch.bfloat16, 0)
        t = next(iter(dev.values()))
        pair = pair_pages(describe(t, kv_layout="HND"), describe(torch.empty(t.shape, dtype=t.dtype), kv_layout="HND"))
        assert (pair.run_bytes, pair.runs_per_page) == (run, runs), layout


def test_strides_match_vllm():
    vllm_iface = pytest.importorskip("vllm.v1.kv_cache_interface")
    from vllm.v1.kv_cache_layout import KVCacheLayout

    spec = vllm_iface.FullAttentionSpec(block_size=N, num_kv_heads=4, head_size=64, dtype=torch.bfloat16)
    for layout, order in ORDERS.items():
        shape = (L, *vllm_iface.compute_layer_kv_cache_shape_bytes(spec, NB))
        strides = _byte_strides(order, shape)
        assert vllm_iface.compute_layout_strides(spec, NB, L, KVCacheLayout[layout]) == strides, layout
        # and vLLM's own layer views of one allocation are ours, view for view
        raw, ours = _vllm_caches(layout, 4, 128, torch.bfloat16, 0)
        names = list(ours)
        tensor = vllm_iface.KVCacheTensor(size=raw.numel(), layers=names, layer_stride=strides[0],
                                          block_stride=strides[1])
        theirs = vllm_iface.create_kv_cache_views(raw, spec, NB, KVCacheLayout[layout], tensor)
        for name, view in zip(names, theirs):
            mine = ours[name]
            assert (view.shape, view.stride(), view.dtype, view.data_ptr()) == \
                (mine.shape, mine.stride(), mine.dtype, mine.data_ptr()), (layout, name)
