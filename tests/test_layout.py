"""kvcopy.layout: where block bytes sit, for every layout vLLM has used."""
import pytest
import torch

from kvcopy.layout import alignment, byte_extent, describe, infer_block_dim

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
