"""kvcopy.core.layout: where block bytes sit, for every layout vLLM has used."""
import pytest
import torch

from kvcopy.core.layout import alignment, byte_extent, describe, infer_block_dim

NB, BS, H, D = 6, 4, 2, 8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.uint8, torch.float32])
def test_blocks_first_nhd_is_one_chunk_per_page(dtype):
    t = torch.zeros(NB, BS, H, D, dtype=dtype)
    lay = describe(t)
    isz = t.element_size()
    assert (lay.block_dim, lay.num_blocks, lay.num_chunks) == (0, NB, 1)
    assert lay.chunk_bytes == BS * H * D * isz == lay.block_stride
    assert (lay.token_dim, lay.head_dim, lay.kind) == (1, 2, "blocks_first")


def test_hnd_names_head_and_token_axes():
    lay = describe(torch.zeros(NB, H, BS, D, dtype=torch.float16), kv_layout="HND")
    assert (lay.token_dim, lay.head_dim) == (2, 1)
    assert lay.num_chunks == 1


def test_kv_first_is_two_chunks_nb_pages_apart():
    t = torch.zeros(2, NB, BS, H, D, dtype=torch.bfloat16)
    lay = describe(t)
    page = BS * H * D * 2
    assert lay.block_dim == 1 and lay.kind == "kv_first"
    assert (lay.num_chunks, lay.chunk_bytes, lay.chunk_stride, lay.block_stride) == (2, page, NB * page, page)


def test_blocks_first_with_kv_axis_is_one_chunk():
    lay = describe(torch.zeros(NB, 2, BS, H, D, dtype=torch.bfloat16))
    assert lay.num_chunks == 1 and lay.chunk_bytes == 2 * BS * H * D * 2


def test_hnd_view_of_nhd_storage_is_contiguous_page_with_its_own_geometry():
    base = torch.zeros(NB, BS, H, 2 * D, dtype=torch.bfloat16)
    view = base.transpose(1, 2)  # (NB, H, BS, 2D)
    lay = describe(view, kv_layout="HND")
    assert lay.num_chunks == 1 and lay.chunk_bytes == BS * H * 2 * D * 2
    # Same bytes per page, different element order: not the same page geometry as a
    # contiguous HND tensor, so the copier refuses to pair them.
    assert not lay.same_page_geometry(describe(torch.zeros(NB, H, BS, 2 * D, dtype=torch.bfloat16)))
    assert lay.same_page_geometry(describe(torch.zeros_like(base).transpose(1, 2)))


def test_mla():
    lay = describe(torch.zeros(NB, BS, 576, dtype=torch.bfloat16))
    assert lay.kind == "mla" and lay.head_dim is None and lay.token_dim == 1


def test_ambiguous_kv_first_needs_block_dim():
    t = torch.zeros(2, 2, BS, H, D)
    with pytest.raises(ValueError, match="block_dim"):
        describe(t)
    assert describe(t, block_dim=1).num_chunks == 2
    assert describe(t, block_dim=0).num_chunks == 1
    assert infer_block_dim((2, 7, BS, H, D)) == 1


def test_head_slice_of_nhd_is_one_chunk_per_token():
    t = torch.zeros(NB, BS, 2 * H, D)[:, :, :H]
    lay = describe(t)
    assert (lay.num_chunks, lay.chunk_bytes, lay.chunk_stride) == (BS, H * D * 4, 2 * H * D * 4)


def test_page_needing_two_chunk_axes_is_refused():
    t = torch.zeros(2, NB, BS, 2 * H, D)[:, :, :, :H]
    with pytest.raises(ValueError, match="contiguous"):
        describe(t)


def test_bad_arguments():
    with pytest.raises(TypeError):
        describe([1, 2, 3])
    with pytest.raises(ValueError, match="kv_layout"):
        describe(torch.zeros(NB, BS, H, D), kv_layout="XYZ")
    with pytest.raises(ValueError, match="out of range"):
        describe(torch.zeros(NB, BS, H, D), block_dim=4)
    with pytest.raises(ValueError, match="at least 2"):
        describe(torch.zeros(NB))


def test_extent_and_alignment():
    t = torch.zeros(2, NB, BS, H, D, dtype=torch.uint8)
    start, end = byte_extent(t)
    assert end - start == t.numel()
    assert alignment(64, 32, 4096) == 16 and alignment(6) == 2 and alignment(7, 16) == 1


def test_single_head_permuted_view_matches_contiguous():
    """Size-1 dims carry no bytes: a permuted one-head tensor pairs with a contiguous one."""
    dev = torch.zeros(NB, 1, BS, D).permute(0, 2, 1, 3)  # [NB, BS, 1, D] with odd strides
    host = torch.zeros(NB, BS, 1, D)
    assert describe(dev).same_page_geometry(describe(host))


def test_overlapping_chunks_of_different_blocks_are_refused():
    # 2 chunks of 16 bytes, blocks 48 bytes apart but chunks only 16 apart... block b's
    # second chunk would be block b+1's first: refused, never copied.
    t = torch.zeros(200, dtype=torch.uint8).as_strided((2, 5, 16), (48, 16, 1))
    with pytest.raises(ValueError, match="overlap"):
        describe(t, block_dim=1)
    t = torch.zeros(8 * 16, dtype=torch.uint8).as_strided((4, 16), (0, 1))  # every block the same bytes
    with pytest.raises(ValueError, match="overlap"):
        describe(t)


# ---------------------------------------------------------------------- page pairs
from kvcopy.core.layout import MAX_RUN_DIMS, pair_pages  # noqa: E402


def _pair(a, b, **kw):
    return pair_pages(describe(a, **kw), describe(b, **kw))


def test_identical_orders_keep_whole_pages_and_kv_first_chunks():
    t = torch.zeros(NB, BS, H, D, dtype=torch.bfloat16)
    p = _pair(t, torch.zeros_like(t))
    assert (p.run_bytes, p.runs_per_page) == (BS * H * D * 2, 1)
    assert p.dims == ((1, 0, 0),) * MAX_RUN_DIMS
    v = torch.zeros(NB, BS, H, 2 * D).transpose(1, 2)  # HND view of NHD on both sides: one range
    assert _pair(v, torch.zeros(NB, BS, H, 2 * D).transpose(1, 2)).runs_per_page == 1
    kv = torch.zeros(2, NB, BS, H, D, dtype=torch.bfloat16)
    host = torch.zeros(2, NB + 3, BS, H, D, dtype=torch.bfloat16)  # K/V apart by another NB
    p = _pair(kv, host)
    page = BS * H * D * 2
    assert (p.run_bytes, p.runs_per_page) == (page, 2)
    assert p.dims[-1] == (2, NB * page, (NB + 3) * page)


def test_lbnhc_against_contiguous_host_moves_c_runs():
    c = 2 * D
    dev = torch.zeros(NB, BS, H, c, dtype=torch.bfloat16).permute(0, 2, 1, 3)  # [B, H, N, C] of [B, N, H, C]
    host = torch.zeros(NB, H, BS, c, dtype=torch.bfloat16)
    p = _pair(dev, host, kv_layout="HND")
    assert (p.run_bytes, p.runs_per_page) == (c * 2, H * BS)
    # run r's digits over the dims land on the same logical (head, token) on both sides
    seen = set()
    for r in range(p.runs_per_page):
        (c0, s0, d0), (c1, s1, d1), (c2, s2, d2) = p.dims
        i2, q = r % c2, r // c2
        i1, i0 = q % c1, q // c1
        src, dst = i0 * s0 + i1 * s1 + i2 * s2, i0 * d0 + i1 * d1 + i2 * d2
        tok, head = divmod(src // (c * 2), H)  # source page is [N, H, C]
        assert dst == (head * BS + tok) * c * 2  # destination page is [H, N, C]
        seen.add(dst)
    assert len(seen) == p.runs_per_page


def test_pairs_that_cannot_be_copied_name_both_layouts():
    a = torch.zeros(NB, BS, H, D, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"logical page shape \(4, 2, 8\).*vs \(2, 4, 8\).*blocks_first"):
        _pair(a, torch.zeros(NB, H, BS, D, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="element size 2 vs 4 bytes"):
        _pair(a, torch.zeros(NB, BS, H, D, dtype=torch.float32))
    # every in-page dim reversed: no contiguous run on both sides, 4 dims of 1-element runs
    src = torch.zeros(NB, 2, 3, 4, 5, dtype=torch.uint8)
    dst = torch.zeros(NB, 5, 4, 3, 2, dtype=torch.uint8).permute(0, 4, 3, 2, 1)
    with pytest.raises(ValueError, match=f"more than {MAX_RUN_DIMS} nested dims"):
        pair_pages(describe(src, block_dim=0), describe(dst, block_dim=0))


@pytest.mark.parametrize("bad", [True, False, 1.0, "0", [0]])
def test_block_dim_must_be_an_int(bad):
    """``block_dim=True`` was taken as 1 (a bool is an int to Python, not to kvcopy)."""
    with pytest.raises(TypeError, match="block_dim must be an integer"):
        describe(torch.zeros(NB, BS, H, D), block_dim=bad)
    assert describe(torch.zeros(NB, BS, H, D), block_dim=0).block_dim == 0


def test_lazy_value_views_and_nested_tensors_are_type_errors():
    import warnings

    with pytest.raises(TypeError, match="conj"):
        describe(torch.zeros(NB, BS, H, D, dtype=torch.complex64).conj())
    with pytest.raises(TypeError, match="negative-bit"):
        describe(torch._neg_view(torch.zeros(NB, BS, H, D)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors warn that their API is a prototype
        nested = torch.nested.nested_tensor([torch.zeros(BS, H, D), torch.zeros(BS, H, D)])
    with pytest.raises(TypeError, match="nested"):
        describe(nested)
    with pytest.raises(TypeError, match="torch.Tensor"):
        describe([[0]])
